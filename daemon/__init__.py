"""metaroced, the MetaRoCE daemon: hosts the data plane for other processes (shared-memory rings,
Unix-socket control, systemd service).  The logic lives in metaroce_xdp.daemon; this package is the
process's entry: `python -m daemon`, the script daemon/metaroced, or the installed `metaroced`."""
