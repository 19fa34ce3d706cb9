"""`python -m metaroce_xdp.daemon [flags]`: run metaroced (main.py; `--help`)."""
import sys

from .main import main

sys.exit(main())
