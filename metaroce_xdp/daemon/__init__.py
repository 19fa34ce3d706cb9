"""metaroced: the daemon that hosts the compiled data plane for other processes (shared-memory rings,
Unix-socket control, systemd service).  Entry point: daemon/metaroced (`python -m daemon`)."""
