"""One verbs surface (metaroce_xdp/verbs.py): the compiled plane in process (dp/context.py) and metaroced's
client library (daemon/client.py) implement every method of the protocols with the same parameters, raise
the same error classes and return the same AsyncEvent; the destroy convention holds on the compiled plane
(objects reused after destruction, EBUSY while in use, InvalidState the second time).  test_peer_loss checks
QP.query()'s keys (verbs.QUERY_KEYS) on both, live."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

from metaroce_xdp import verbs, verbs_types
from metaroce_xdp.daemon import client, proto
from metaroce_xdp.dp import context as dp
from metaroce_xdp.dp import layout as L
from metaroce_xdp.verbs_types import InvalidState, QPCap, ResourceError


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
    nq = len(ctx.plane.group)
    for i in range(L.MAX_CQS // nq + 8):
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
