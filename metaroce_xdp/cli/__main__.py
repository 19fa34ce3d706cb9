"""`python -m metaroce_xdp.cli ARGS`: the `metaroce` command."""
from .main import main

main()
