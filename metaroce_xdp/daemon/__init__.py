"""metaroced: the daemon that hosts the compiled data plane for other processes (shared-memory rings,
Unix-socket control, systemd service).  Entry points: the installed `metaroced`, daemon/metaroced in a checkout, `python -m metaroce_xdp.daemon`."""
