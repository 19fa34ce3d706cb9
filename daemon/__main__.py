"""`python -m daemon [flags]`: run metaroced (see metaroce_xdp/daemon/main.py, `--help`)."""
import sys

from metaroce_xdp.daemon.main import main

sys.exit(main())
