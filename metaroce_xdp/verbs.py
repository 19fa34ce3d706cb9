"""The verbs surface both endpoints offer: the compiled plane in process (`metaroce_xdp.Context`, dp/context.py)
and metaroced's client library (`metaroce_xdp.daemon.client`).  Code written against these protocols runs on
either; tests/test_verbs_surface.py checks that both implement every method here with these parameters.

The shapes follow libibverbs (`ibv_alloc_pd`, `ibv_reg_mr`, `ibv_create_cq`, `ibv_create_qp`, `ibv_modify_qp`,
`ibv_post_send`, `ibv_poll_cq`, `ibv_get_async_event`), with pyverbs' habit of methods on the objects:

* destroying: each object has its own method (`qp.destroy()`, `cq.destroy()`, `mr.dereg()`, `pd.dealloc()`),
  and the Context has the libibverbs spelling of each (`destroy_qp`, `destroy_cq`, `dereg_mr`, `dealloc_pd`);
  destroying an object something still uses (a CQ a QP reports to, a PD with MRs or QPs) raises
  ResourceError (EBUSY), destroying one twice InvalidState.
* errors: the typed errors of verbs_types (InvalidArgument, InvalidState, QueueFull, ResourceError,
  Unsupported -- the same classes from both);
* events: `get_async_event` returns verbs_types.AsyncEvent (an EventType, the QP or CQ, the reason);
* `QP.query()` returns a dict with at least QUERY_KEYS.

Either endpoint has more (the compiled plane: completion channels, `progress()`, native-profile counters;
the client: connection set-up through metaroced, `alloc_buf`); code that uses those names its endpoint.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .verbs_types import SGE, WC, Access, AsyncEvent, QPAttr, QPCap, QPState, RecvWR, SendWR

#: what `QP.query()` returns on both endpoints (more keys may follow)
QUERY_KEYS = frozenset({"qp_num", "state", "error", "sq_psn", "rq_psn", "path_mtu", "dest_qp_num", "profile",
                        "retransmits"})


@runtime_checkable
class VerbsMR(Protocol):
    addr: int
    length: int
    lkey: int
    rkey: int

    def sge(self, offset: int, length: int) -> SGE: ...

    def dereg(self) -> None: ...


@runtime_checkable
class VerbsPD(Protocol):
    def reg_mr(self, buf: Any, access: Access = Access.LOCAL_WRITE) -> VerbsMR: ...

    def dealloc(self) -> None: ...


@runtime_checkable
class VerbsCQ(Protocol):
    def poll(self, num_entries: int = 16) -> list[WC]: ...

    def wait(self, n: int = 1, timeout: float = 10.0) -> list[WC]: ...

    def destroy(self) -> None: ...


@runtime_checkable
class VerbsQP(Protocol):
    qp_num: int

    def modify(self, attr: QPAttr) -> None: ...

    def query(self) -> dict: ...

    def query_state(self) -> QPState: ...

    def post_send(self, wrs: SendWR | list[SendWR]) -> None: ...

    def post_recv(self, wrs: RecvWR | list[RecvWR]) -> None: ...

    def destroy(self) -> None: ...


@runtime_checkable
class VerbsContext(Protocol):
    def alloc_pd(self) -> VerbsPD: ...

    def dealloc_pd(self, pd: Any) -> None: ...

    def reg_mr(self, pd: Any, buf: Any, access: Access = Access.LOCAL_WRITE) -> VerbsMR: ...

    def dereg_mr(self, mr: Any) -> None: ...

    def create_cq(self, depth: int = 1024, cq_context: Any = None, channel: Any = None) -> VerbsCQ: ...

    def destroy_cq(self, cq: Any) -> None: ...

    def create_qp(self, pd: Any, send_cq: Any, recv_cq: Any, cap: QPCap | None = None,
                  sq_sig_all: bool = False) -> VerbsQP: ...

    def destroy_qp(self, qp: Any) -> None: ...

    def get_async_event(self, timeout: float | None = 0.0) -> AsyncEvent | None: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


PROTOCOLS = {"Context": VerbsContext, "PD": VerbsPD, "MR": VerbsMR, "CQ": VerbsCQ, "QP": VerbsQP}
