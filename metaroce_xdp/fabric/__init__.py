"""An emulated data-centre fabric on one machine (`metaroce fabric`): hosts in network namespaces
behind leaf routers, a spine, several parallel links per hop with ECMP routes that hash on the
UDP source port, and a BPF program on every switch port that drops, duplicates, reorders and
corrupts frames with seeded coins and models a bottleneck queue that CE-marks and drops like a
DCTCP-configured switch.  docs/fabric.md describes the design and the commands.

    from metaroce_xdp.fabric import up, down, Fabric
    fab = up("lab", hosts=2, paths=4)
    fab.set("sp:l2.*", rate_bps=10**9, mark_depth=30_000, drop_depth=200_000)
    ...
    down("lab")

Modules: topology.py (the plan and the namespaces), impair.py (the BPF program and its maps),
manage.py (up/set/show/down and the record), units.py (command-line quantities).
"""
from .impair import COUNTERS, SCOPES, fab_mix, plan, port_seed
from .manage import DEFAULT_NAME, Fabric, down, list_fabrics, pin_dir, state_path, up
from .topology import FabricError, Host, Plan, Port, make_plan

__all__ = ["COUNTERS", "DEFAULT_NAME", "SCOPES", "Fabric", "FabricError", "Host", "Plan", "Port", "down",
           "fab_mix", "list_fabrics", "make_plan", "pin_dir", "plan", "port_seed", "state_path", "up"]
