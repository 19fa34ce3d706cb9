"""One verbs surface (metaroce_xdp/verbs.py): the compiled plane in process (dp/context.py) and metaroced's
client library (daemon/client.py) implement every method of the protocols with the same parameters, raise
the same error classes and return the same AsyncEvent; the destroy convention holds on the compiled plane
(objects reused after destruction, EBUSY while in use, InvalidState the second time); post_send refuses a bad
work request with the same error and message on both (verbs.check_send_wr), nothing of the list posted.
test_peer_loss checks QP.query()'s keys (verbs.QUERY_KEYS) on both, live."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

from metaroce_xdp import verbs, verbs_types
from metaroce_xdp.daemon import client, proto
from metaroce_xdp.dp import context as dp
from metaroce_xdp.dp import layout as L
from metaroce_xdp.verbs_types import (SGE, Access, InvalidArgument, InvalidState, QPAttr, QPCap, QPState,
                                      ResourceError, SendFlags, SendWR, Unsupported, VerbsError, WCStatus, WROpcode)


def _members(proto_cls):
    """(name, signature or None for a data member) of a protocol's own members."""
    out = {}
    for klass in proto_cls.__mro__:
        if klass.__module__ != verbs.__name__:
            continue
        for name in getattr(klass, "__annotations__", {}):
            out.setdefault(name, None)
        for name, f in vars(klass).items():
            if not name.startswith("_") and callable(f):
                out[name] = inspect.signature(f)
    return out


@pytest.mark.parametrize("impl", [dp, client], ids=["compiled plane", "metaroced client"])
@pytest.mark.parametrize("name", sorted(verbs.PROTOCOLS))
def test_both_endpoints_implement_the_protocol(impl, name):
    cls = getattr(impl, name)
    for member, want in _members(verbs.PROTOCOLS[name]).items():
        if want is None:                        # a data member: set in __init__ or a property
            src = inspect.getsource(cls)
            assert f"self.{member}" in src or isinstance(getattr(cls, member, None), property), (cls, member)
            continue
        f = getattr(cls, member, None)
        assert callable(f), f"{cls.__module__}.{name} has no {member}()"
        have = list(inspect.signature(f).parameters.values())
        need = list(want.parameters.values())
        assert [p.name for p in have[:len(need)]] == [p.name for p in need], (cls, member, have, need)
        for p, q in zip(have, need):            # the protocol's optional parameters stay optional
            assert (p.default is inspect.Parameter.empty) == (q.default is inspect.Parameter.empty), (cls, member, p)
        for p in have[len(need):]:              # and what an endpoint adds is optional
            assert p.default is not inspect.Parameter.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL), \
                (cls, member, p)


def test_one_error_and_event_vocabulary():
    assert dp.Unsupported is proto.Unsupported is client.Unsupported is verbs_types.Unsupported
    assert dp.AsyncEvent is client.AsyncEvent is verbs_types.AsyncEvent
    ev = verbs_types.AsyncEvent(verbs_types.EventType.EVENTS_LOST, count=3)
    assert ev.count == 3 and "EVENTS_LOST" in repr(ev)
    # the error a daemon reply names comes back as the same class
    with pytest.raises(verbs_types.Unsupported, match="nope"):
        proto.raise_error(proto.error_reply(verbs_types.Unsupported("nope")))


def test_destroy_convention_on_the_compiled_plane(dp_loop):
    """CQs are reused after destroy_cq (more than MAX_CQS created over a context's life); destroying a CQ a
    QP reports to is EBUSY, a PD with MRs too; destroying anything twice is InvalidState; both spellings
    (ctx.destroy_cq(cq), cq.destroy()) do the same."""
    a, _ = dp_loop()
    ctx = a.ctx
    for i in range(L.MAX_CQS + 8):
        cq = ctx.create_cq(64)
        (cq.destroy if i % 2 else lambda: ctx.destroy_cq(cq))()
    with pytest.raises(InvalidState):
        cq.destroy()
    busy = ctx.create_cq(64)
    pd = ctx.alloc_pd()
    qp = ctx.create_qp(pd, busy, busy, QPCap(max_send_wr=4, max_recv_wr=4))
    with pytest.raises(ResourceError):
        busy.destroy()
    with pytest.raises(ResourceError):
        pd.dealloc()
    qp.destroy()
    with pytest.raises(InvalidState):
        ctx.destroy_qp(qp)
    busy.destroy()
    with pytest.raises(InvalidState):
        ctx.create_qp(pd, busy, busy)
    mr = pd.reg_mr(np.zeros(4096, np.uint8))
    sge = mr.sge(8, 100)
    assert (sge.addr, sge.length, sge.lkey) == (mr.addr + 8, 100, mr.lkey)
    mr.dereg()
    pd.dealloc()
    with pytest.raises(InvalidState):
        pd.dealloc()
    with pytest.raises(InvalidState):
        pd.reg_mr(np.zeros(4096, np.uint8))


# ---- one send-WR validation -------------------------------------------------------------------------------
SIG = SendFlags.SIGNALED
LKEY = 0x1234


def _bad_wrs(sge, remote: int, rkey: int) -> list[tuple[str, list[SendWR]]]:
    """Work requests neither endpoint takes, for the same reason; sge(offset, length) -> SGE of the local MR,
    remote/rkey: the peer's MR.  Each is (why, the list posted)."""
    def write(wr_id=1, sg=None, flags=SIG, op=WROpcode.RDMA_WRITE, addr=remote):
        return SendWR(wr_id=wr_id, opcode=op, sg_list=[sge(0, 8)] if sg is None else sg, send_flags=flags,
                      remote_addr=addr, rkey=rkey, compare_add=1)
    bad = [("an opcode verbs does not know", [write(op=7)]),
           ("17 SGEs on a QP of max_send_sge 16", [write(sg=[sge(0, 8)] * 17)]),
           ("an SGE of negative length", [write(sg=[SGE(sge(0, 8).addr, -1, sge(0, 8).lkey)])]),
           ("an SGE of 2^32 bytes (an ibv_sge's length is a uint32)",
            [write(sg=[SGE(sge(0, 8).addr, 1 << 32, sge(0, 8).lkey)])]),
           ("INLINE data with max_inline 0", [write(flags=SIG | SendFlags.INLINE)]),
           ("a send flag verbs does not know", [write(flags=SIG | 0x100)]),
           ("an atomic with a 4-byte SGE", [write(op=WROpcode.ATOMIC_FETCH_AND_ADD, sg=[sge(0, 4)])]),
           ("an atomic at an address not a multiple of 8", [write(op=WROpcode.ATOMIC_CMP_AND_SWP, addr=remote + 4)])]
    bad.append(("a good WR, then a bad one", [write(wr_id=2), bad[-1][1][0]]))
    return bad


def _refusal(post, wrs) -> tuple[type, str]:
    with pytest.raises(VerbsError) as e:
        post(wrs)
    return type(e.value), str(e.value)


def test_one_check_for_both_planes():
    """verbs.check_send_wr with each endpoint's PostRules: the same error for what no endpoint takes; what only
    metaroced's data plane lacks (one SGE per WR, an SGE of 2^31 bytes or more, and INLINE) is Unsupported
    naming it; SEND_WITH_INV and FENCE pass both; a native QP refuses SEND_WITH_INV with EINVAL on both
    (MR-NAT-010); atomics without ATOMICS agreed are refused on both (MR-CM-019); both queue sends in SQD
    (MR-QP-018)."""
    planes = (dp.COMPILED_POST, client.DAEMON_POST)
    for why, wrs in _bad_wrs(lambda off, n: SGE(0x10000 + off, n, LKEY), 0x20000, 7):
        got = set()
        for rules in planes:
            with pytest.raises(VerbsError) as e:
                for wr in wrs:
                    verbs.check_send_wr(wr, rules, 16)
            got.add((type(e.value), str(e.value)))
        assert len(got) == 1 and not issubclass(got.pop()[0], Unsupported), (why, got)
    inv = SendWR(1, WROpcode.SEND_WITH_INV, [SGE(0x10000, 8, LKEY)], invalidate_rkey=5)
    for wr in (inv, SendWR(1, WROpcode.RDMA_WRITE, [SGE(0x10000, 8, LKEY)], SIG | SendFlags.FENCE)):
        for rules in planes:
            assert verbs.check_send_wr(wr, rules, 16) == 8
    only_compiled = [SendWR(1, WROpcode.SEND, [SGE(0x10000, 8, LKEY)] * 2),
                     SendWR(1, WROpcode.SEND, [], SIG | SendFlags.INLINE),
                     SendWR(1, WROpcode.RDMA_WRITE, [SGE(0x10000, 1 << 31, LKEY)])]     # a valid message (MR-RC-008)
    for wr in only_compiled:
        assert verbs.check_send_wr(wr, dp.COMPILED_POST, 16) == sum(s.length for s in wr.sg_list)
        with pytest.raises(Unsupported, match="the daemon's data plane"):
            verbs.check_send_wr(wr, client.DAEMON_POST, 16)
    for rules in planes:
        with pytest.raises(InvalidArgument, match="MR-NAT-010") as e:
            verbs.check_send_wr(inv, rules, 16, profile="native")
        assert type(e.value) is InvalidArgument
        atomic = SendWR(1, WROpcode.ATOMIC_FETCH_AND_ADD, [SGE(0x10000, 8, LKEY)], remote_addr=0x20000)
        assert verbs.check_send_wr(atomic, rules, 16, atomics=True) == 8
        with pytest.raises(InvalidArgument, match="MR-CM-019"):
            verbs.check_send_wr(atomic, rules, 16, atomics=False)
    with pytest.raises(InvalidState, match="post_send on a QP in RTR: move it to RTS first"):
        verbs.check_post_state(int(QPState.RTR), client.DAEMON_POST)
    for rules in planes:
        verbs.check_post_state(int(QPState.SQD), rules)


def test_both_endpoints_post_through_the_one_check():
    """No endpoint keeps a send-WR check of its own: the messages live in verbs.py only.  (The compiled
    plane's post_send_n, which posts copies of a row send_wqe checked, keeps its own state check.)"""
    for mod in (dp, client):
        src = inspect.getsource(mod)
        assert "check_send_wr(" in src and "check_post_state(" in src and "check_sg_list(" in src, mod
        for msg in ("8-byte SGE", "unknown send opcode", "SGEs > max", "SGE length", "did not agree ATOMICS",
                    "no native opcode"):
            assert msg not in src, (mod.__name__, msg)


@pytest.mark.netns
@pytest.mark.timeout(600)
def test_bad_send_wrs_are_refused_alike_in_process_and_through_metaroced():
    """The same bad work requests posted on a QP of the compiled plane in process (host A) and on a QP of a
    metaroced client (host B), the two QPs connected to each other: the same error class and message from
    both, nothing posted (the send queue stays empty), and afterwards each QP carries a WRITE to the other.
    Then the same with ATOMICS not agreed (MR-CM-019), and posting before RTS (MR-QP-018)."""
    import daemon_watch
    from metaroce_xdp import shm
    from metaroce_xdp.topo import two_hosts
    full = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
    cap = QPCap(max_send_wr=16, max_recv_wr=16)
    topo, _ = two_hosts()
    try:
        with daemon_watch.serving(topo, topo[1], "mr1", tag="mrverbs") as (sock, _, _), \
                topo.enter(topo[0]), dp.Context.open("mr0", progress_thread=True) as a_ctx, \
                client.connect(sock, "mr1") as b_ctx:
            a_buf, b_buf = np.zeros(1 << 16, np.uint8), b_ctx.alloc_buf(1 << 16)
            a_pd, b_pd = a_ctx.alloc_pd(), b_ctx.alloc_pd()
            a_mr, b_mr = a_pd.reg_mr(a_buf, full), b_pd.reg_mr(b_buf, full)
            a_cq, b_cq = a_ctx.create_cq(64), b_ctx.create_cq(64)
            a_qp, b_qp = a_ctx.create_qp(a_pd, a_cq, a_cq, cap), b_ctx.create_qp(b_pd, b_cq, b_cq, cap)
            a_idle, b_idle = a_ctx.create_qp(a_pd, a_cq, a_cq, cap), b_ctx.create_qp(b_pd, b_cq, b_cq, cap)
            for qp, peer, ip in ((a_qp, b_qp, "10.77.0.2"), (b_qp, a_qp, "10.77.0.1")):
                qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=full))
                qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp_num, rq_psn=0, path_mtu=1024, dgid=ip,
                                 max_dest_rd_atomic=4, min_rnr_timer=1))
                qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0, timeout=14, retry_cnt=7, rnr_retry=7,
                                 max_rd_atomic=4))
            a_queued = lambda: a_qp.query()["sq_outstanding"]                   # noqa: E731
            b_queued = lambda: int(b_qp.W[shm.QH_SQ_TAIL]) - int(b_qp.W[shm.QH_SQ_HEAD])   # noqa: E731
            sides = ((a_qp, a_mr, b_mr, a_queued), (b_qp, b_mr, a_mr, b_queued))

            def alike(why, make):
                got = []
                for qp, mine, theirs, queued in sides:
                    got.append(_refusal(qp.post_send, make(mine, theirs)))
                    assert queued() == 0, (why, qp)
                assert got[0] == got[1] and got[0][0] is not VerbsError, (why, got)

            # the same remote address on both (a message may name it): none of these WRs leaves
            for i, (why, _) in enumerate(_bad_wrs(a_mr.sge, 0x10000, 7)):
                alike(why, lambda mine, theirs, i=i: _bad_wrs(mine.sge, 0x10000, 7)[i][1])
            atomic = lambda mine, theirs: SendWR(3, WROpcode.ATOMIC_FETCH_AND_ADD, [mine.sge(256, 8)],  # noqa: E731
                                                 remote_addr=theirs.addr + 8192, rkey=theirs.rkey, compare_add=1)
            a_qp.atomics = b_qp.atomics = False             # what set-up records when ATOMICS was not agreed
            alike("an atomic without ATOMICS agreed", lambda m, t: [atomic(m, t)])
            a_qp.atomics = b_qp.atomics = None
            for state in (QPState.RESET, QPState.INIT):
                if state == QPState.INIT:
                    for qp in (a_idle, b_idle):
                        qp.modify(QPAttr(qp_state=state, qp_access_flags=full))
                got = {_refusal(qp.post_send, SendWR(4, WROpcode.SEND)) for qp in (a_idle, b_idle)}
                assert got == {(InvalidState, f"post_send on a QP in {state.name}: move it to RTS first")}, got

            # nothing was posted: each QP's next WRITE and atomic are its first, and complete
            a_buf[:64], b_buf[:64] = 0xA1, 0xB2
            for qp, cq, mine, theirs in ((a_qp, a_cq, a_mr, b_mr), (b_qp, b_cq, b_mr, a_mr)):
                qp.post_send([SendWR(10, WROpcode.RDMA_WRITE, [mine.sge(0, 64)], remote_addr=theirs.addr + 4096,
                                     rkey=theirs.rkey), atomic(mine, theirs)])
                wcs = cq.wait(2, 10)
                assert [(w.wr_id, w.status) for w in wcs] == [(10, WCStatus.SUCCESS), (3, WCStatus.SUCCESS)], wcs
            assert (b_buf[4096:4160] == 0xA1).all() and (a_buf[4096:4160] == 0xB2).all()
            assert a_qp.query_state() == b_qp.query_state() == QPState.RTS
    finally:
        topo.close()
