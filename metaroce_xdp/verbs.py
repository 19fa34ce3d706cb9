"""The verbs surface both endpoints offer: the compiled plane in process (`metaroce_xdp.Context`, dp/context.py)
and metaroced's client library (`metaroce_xdp.daemon.client`).  Code written against these protocols runs on
either; tests/dp/test_verbs_surface.py checks that both implement every method here with these parameters.

The shapes follow libibverbs (`ibv_alloc_pd`, `ibv_reg_mr`, `ibv_create_cq`, `ibv_create_qp`, `ibv_modify_qp`,
`ibv_post_send`, `ibv_poll_cq`, `ibv_get_async_event`), with pyverbs' habit of methods on the objects:

* destroying: each object has its own method (`qp.destroy()`, `cq.destroy()`, `mr.dereg()`, `pd.dealloc()`),
  and the Context has the libibverbs spelling of each (`destroy_qp`, `destroy_cq`, `dereg_mr`, `dealloc_pd`);
  destroying an object something still uses (a CQ a QP reports to, a PD with MRs or QPs) raises
  ResourceError (EBUSY), destroying one twice InvalidState.
* errors: the typed errors of verbs_types (InvalidArgument, InvalidState, QueueFull, ResourceError,
  Unsupported -- the same classes from both);
* events: `get_async_event` returns verbs_types.AsyncEvent (an EventType, the QP or CQ, the reason);
* `QP.query()` returns a dict with at least QUERY_KEYS;
* posting: `QP.post_send` refuses a bad work request with the same error and message on both
  (check_send_wr below; what differs is the endpoint's PostRules), and a list whole or not at all.

Either endpoint has more (the compiled plane: completion channels, `progress()`, native-profile counters;
the client: connection set-up through metaroced, `alloc_buf`); code that uses those names its endpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

from .verbs_types import (SGE, WC, Access, AsyncEvent, InvalidArgument, InvalidState, QPAttr, QPCap, QPState, RecvWR,
                          SendFlags, SendWR, Unsupported, WROpcode)

#: the per-QP receive counters both endpoints report in `QP.query()` (MR-DUP-010, MR-MEM-019, MR-ACK-015,
#: MR-SEC-031): duplicates, requests after the expected PSN, remote access errors, RNR NAKs sent, stale and
#: ghost responses, the bad response that ended the QP
QP_RX_COUNTERS = ("rx_dup_req", "rx_drop_out_of_seq", "rx_rkey_violation", "rnr_naks_sent", "rx_stale_rsp",
                  "rx_ghost_rsp", "rx_bad_rsp")
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

    def req_notify(self, solicited_only: bool = False) -> None: ...

    def get_event(self, timeout: float | None = 0.0) -> bool: ...

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


# ---- ibv_post_send's checks, one set for both endpoints ------------------------------------------------
#
# Both endpoints refuse a bad send work request at post time with the same error and message, through
# check_send_wr; what differs is the endpoint's data plane, given as a PostRules (dp/context.py COMPILED_POST,
# daemon/client.py DAEMON_POST).  What is checked here is the WR itself; the local SGEs against the MR table
# are each endpoint's (an SGE outside its MR completes LOC_PROT_ERR in process, MR-RC-022; the daemon's client
# refuses it at post).  metaroced checks every ring entry again in its loop (dp/serve.pump_qp): the client
# library is not trusted there.

#: the send opcodes of the verbs surface (WROpcode), as plain ints (an enum member hashes as its int)
SEND_OPCODES = frozenset(int(o) for o in WROpcode)
ATOMIC_OPCODES = frozenset({int(WROpcode.ATOMIC_CMP_AND_SWP), int(WROpcode.ATOMIC_FETCH_AND_ADD)})
_OP_NAMES = {int(o): o.name for o in WROpcode}
ALL_SEND_FLAGS = int(SendFlags.FENCE | SendFlags.SIGNALED | SendFlags.SOLICITED | SendFlags.INLINE)
_INLINE = int(SendFlags.INLINE)
#: max_inline_data of every QP: neither endpoint copies a WR's data at post time, so an INLINE WR carries none
MAX_INLINE = 0
#: a receive WQE's SGEs add up to at most 2^31 - 1 bytes; a send WR's may add up to more (MR-RC-008: it then
#: completes IBV_WC_LOC_LEN_ERR without a packet, where the plane carries SGEs that long)
MAX_MESSAGE = (1 << 31) - 1
#: an ibv_sge's length is a uint32_t
MAX_SGE_LENGTH = (1 << 32) - 1
# What the native profile has no opcode for (MR-NAT-010: EINVAL at post time), whichever endpoint runs it.
NATIVE_REFUSED = {int(WROpcode.SEND_WITH_INV): "SEND with invalidate has no native opcode (MR-NAT-010)"}
_POST_STATES = frozenset({int(QPState.RTS), int(QPState.SQD), int(QPState.ERR)})


@dataclass(frozen=True)
class PostRules:
    """What one endpoint's data plane carries, where the endpoints differ; check_send_wr refuses the rest
    with Unsupported naming `plane`."""
    plane: str                                   # "the compiled plane", "the daemon's data plane"
    states: frozenset = _POST_STATES             # QP states post_send is allowed in (MR-QP-018)
    opcodes: frozenset = SEND_OPCODES            # the send opcodes it carries
    flags: int = ALL_SEND_FLAGS                  # the send_flags it honours
    max_sge: int = 1 << 16                       # SGEs per work request it carries, whatever the QP's cap
    max_sge_length: int = MAX_SGE_LENGTH         # the longest SGE it carries (up to an ibv_sge's uint32)


def check_post_state(state: int, rules: PostRules) -> None:
    """ibv_post_send in a state that does not allow it (RESET, INIT, RTR: MR-QP-018): InvalidState."""
    if state not in rules.states:
        raise InvalidState(f"post_send on a QP in {QPState(state).name}: move it to RTS first")


def check_sg_list(sg_list: Sequence[SGE], what: str, max_sge: int, rules: PostRules) -> int:
    """The SGE count (the QP's capability `max_sge`, then what the plane carries) and lengths of one work
    request (`what`: its opcode's name, or RECV); returns the message length."""
    n = len(sg_list)
    if n > max_sge:
        raise InvalidArgument(f"{what}: {n} SGEs > max {max_sge}")
    if n > rules.max_sge:
        raise Unsupported(f"{what} with {n} SGEs: {rules.plane} takes at most {rules.max_sge} "
                          f"SGE{'s' if rules.max_sge > 1 else ''} per work request")
    total = 0
    for s in sg_list:
        length = s.length
        if length < 0 or length > MAX_SGE_LENGTH:
            raise InvalidArgument(f"{what}: SGE length {length} out of range")
        if length > rules.max_sge_length:
            raise Unsupported(f"{what}: an SGE of {length} bytes: {rules.plane} takes at most "
                              f"{rules.max_sge_length} bytes per SGE")
        total += length
    if what == "RECV" and total > MAX_MESSAGE:
        raise InvalidArgument(f"{what}: {total} bytes in its SGEs, at most 2^31 - 1")
    return total


def check_send_wr(wr: SendWR, rules: PostRules, max_sge: int, profile: str = "compat",
                  atomics: bool | None = None) -> int:
    """Refuse a send work request no endpoint can post, or this one's plane (`rules`) cannot carry, before
    anything of it is queued; returns its message length.  `max_sge`: the QP's max_send_sge; `profile`: the
    QP's ("native" refuses what has no native opcode); `atomics`: whether its connection agreed ATOMICS
    (False refuses atomics, MR-CM-019; None: set up by hand)."""
    op = wr.opcode
    name = _OP_NAMES.get(op) if isinstance(op, int) else None
    if name is None:
        raise InvalidArgument(f"unknown send opcode {op!r}")
    if profile == "native" and op in NATIVE_REFUSED:
        raise InvalidArgument(NATIVE_REFUSED[op])
    if op not in rules.opcodes:
        raise Unsupported(f"{name} is not implemented by {rules.plane}")
    flags = int(wr.send_flags)
    if flags & ~ALL_SEND_FLAGS:
        raise InvalidArgument(f"send_flags {flags:#x}: unknown bits {flags & ~ALL_SEND_FLAGS:#x}")
    length = check_sg_list(wr.sg_list, name, max_sge, rules)
    if flags & _INLINE and length > MAX_INLINE:
        raise InvalidArgument(f"{name}: INLINE of {length} bytes > max_inline {MAX_INLINE}")
    if flags & ~rules.flags:
        honoured = " and ".join(f.name for f in SendFlags if f & rules.flags)
        raise Unsupported(f"send_flags {SendFlags(flags)!r}: {rules.plane} honours only {honoured}")
    if op in ATOMIC_OPCODES:
        if atomics is False:
            raise InvalidArgument(f"{name} on a QP whose connection did not agree ATOMICS (MR-CM-019)")
        if length != 8 or wr.remote_addr % 8:
            raise InvalidArgument(f"{name} needs one 8-byte SGE for the original value and a remote address "
                                  f"that is a multiple of 8 (MR-XH-011), not {length} bytes at "
                                  f"{wr.remote_addr:#x}")
    return length
