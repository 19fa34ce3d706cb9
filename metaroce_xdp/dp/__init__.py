"""The compiled data plane (issue 7): RC state in arrays, one GIL-free progress loop per port.

`metaroce_xdp.dp.Context.open(ifname)` offers the README's verbs API over it; it is the endpoint
applications get (`from metaroce_xdp import Context`) and what metaroced hosts -- the one implementation
of the transport (scapy, the conformance suite and Linux Soft-RoCE are the independent checks).
Modules by role, as Linux rxe splits its driver: layout.py the tables; ring.py the AF_XDP rings; core.py
what every role shares (numbers, MR checks, frames out, completions, errors); requester.py, completer.py,
responder.py, atomics.py, cc.py (DCQCN) the roles; round.py the progress round (work finding, RX burst,
timers); inproc.py, drive.py, serve.py the compiled entry points; native/plane*.py the native profile;
context.py the control plane and verbs objects; prims.py compiled primitives (raw memory, atomics, libc by
name).  docs/design-dataplane.md says how they fit.
"""
from .context import CQ, MR, PD, QP, Context, Plane, Unsupported

__all__ = ["Context", "CQ", "MR", "PD", "Plane", "QP", "Unsupported"]
