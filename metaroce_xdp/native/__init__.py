"""The native profile's transport logic as compiled, I/O-free building blocks (docs/native.md).

receiver.py  responder: window, duplicates, SACK content and timing, RSN placement and completions
sender.py    requester: scoreboard, RACK, TLP, RTO, congestion control (05-congestion.md)
multipath.py entropy values: weighted spraying, per-path health, eviction and probing
layout.py    the int64 row layouts and the parameter row
"""
from .layout import new_pt, new_rm, new_rx, new_sb, new_tx, params  # noqa: F401
