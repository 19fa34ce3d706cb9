"""`make demo`: the main job on a local two-host topology.

Until the endpoint lands (issue 3) this runs the codec demo only, and says so.
"""
from __future__ import annotations

from . import demo_codec

if __name__ == "__main__":
    raise SystemExit(demo_codec.main())
