"""The MetaRoCE daemon: hosts the engine for other processes (shared-memory rings, systemd
service).  Not built yet: the engine it will host is metaroce_xdp.rc.engine."""
