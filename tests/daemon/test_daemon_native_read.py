"""metaroced serves native READ and atomics (issues 8, 9): real daemons (metaroce_xdp.daemon.server) in
hosts A and B of metaroce_xdp.topo.switched_hosts, real client processes (tests/daemon_native_players.py
and `metaroce perf`, the client library only) in each, the switch namespace between them where the
fault injector drops packets.  A READ or atomic entry of a client's ring becomes the data plane's send
WQE (dp/serve.pump_qp) and the compiled loop does the rest (native/plane.py): request messages of at most
W/2 PSNs (MR-NAT-021/022), responses placed by offset into the client's registered memory in any order
(MR-OOO-017/018), lost responses re-requested (MR-OOO-020..022), atomics executed once and answered
with ATOMIC_ACKNOWLEDGE (MR-NAT-006, MR-OOO-023..025), completions in work-request order (MR-SACK-026)."""
from __future__ import annotations

from pathlib import Path

from daemon_players import Daemons, PlayerProc
from perf_players import perf_run
import pytest

from metaroce_xdp import cm
from metaroce_xdp.verbs_types import EventType

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[2]
OP_NATIVE_READ_REQ, OP_NATIVE_READ_RESP, OP_ATOMIC_ACK = 0xC4, 0xC5, 0x12


class Env(Daemons):
    """Daemons on A (mr0, 10.77.0.1) and B (mr1, 10.77.0.2), the switch between them (topo[1]); clients of
    tests/daemon_native_players.py."""

    PLAYER = str(ROOT / "tests" / "daemon_native_players.py")
    TMP = "mrdread-"

    def __init__(self) -> None:
        super().__init__("switched", port=19640)

    def connected(self, profile: str, size: int = 4 << 20, seeds=(1, 2)) -> tuple[PlayerProc, PlayerProc]:
        """A client on A connected (spec 06, offering `profile`) to a client on B through the two daemons."""
        a, b, _, _, ra, rb = self.connect(size, seeds, profile=profile)
        assert ra["state"] == rb["state"] == "RTS" and ra["profile"] == rb["profile"] == profile, (ra, rb)
        assert ra["atomics"] is True and rb["atomics"] is True          # ATOMICS agreed (MR-CM-019)
        return a, b


@pytest.fixture(scope="module")
def env():
    with Env.running("A", "B") as e:             # both start at once (BCC's compile of the XDP program)
        yield e


def _digest(p: PlayerProc, off: int, n: int) -> str:
    return p.ok(cmd="digest", off=off, len=n)["sha"]


def _perf_read_bw(env: Env, profile: str, iters: int, size: int = 65536) -> tuple[dict, dict]:
    """`metaroce perf read-bw --profile PROFILE` through both daemons: the client (the READ requester) on
    A, the server (the READ responder) on B; each side's JSON."""
    env.port += 1
    prof = ["--profile", profile]
    return perf_run(env.topo, "read-bw", env.port, ["--socket", env.sock("B"), *prof],
                    ["--socket", env.sock("A"), *prof, "-s", str(size), "-n", str(iters), "-t", "32", "-m", "1024"],
                    timeout=180, ns=(env.hosts["A"][0], env.hosts["B"][0]))


def test_perf_read_bw_native_through_metaroced_is_verified(env):
    """`metaroce perf read-bw --profile native` with both ends served by metaroced (MR-NAT-001, MR-CM-016):
    the native profile is agreed, every READ completes and the client's buffer holds the server's pattern
    (the READ responses placed into the client's registered memory, MR-OOO-018); the same test on the
    compat profile beside it, for the record (the numbers go to the report, never asserted)."""
    r, s = _perf_read_bw(env, "native", 400)
    assert r["profile"] == "native" == s["profile"], (r, s)
    assert r["verified"] is True and r["iterations"] == 400 and r["total_bytes"] == 65536 * 400, r
    c, _ = _perf_read_bw(env, "compat", 400)
    assert c["profile"] == "compat" and c["verified"] is True, c
    print(f"\nread-bw through metaroced, 64 KiB x 400: native {r['gbps']:.2f} Gb/s, compat {c['gbps']:.2f} Gb/s")


@pytest.mark.parametrize("profile", ["native", "compat"])
def test_atomics_through_metaroced(env, profile):
    """MR-NAT-006 / MR-ATOM-001..008 (FETCH_ADD and COMPARE_SWAP return the original value, placed in the
    requester's 8-byte SGE), MR-OOO-023/025 (native: executed once, in PSN order), MR-SACK-026 (in work-request
    order among WRITEs and a READ): six FETCH_ADDs between WRITEs, two COMPARE_SWAPs (one matching, one not)
    and a READ of the cell, all through the daemons."""
    a, b = env.connected(profile)
    try:
        cell = 2_000_000
        b.ok(cmd="put_u64", off=cell, value=1000)
        ops = []
        for i in range(6):
            ops.append({"op": "faa", "off": 8 * i, "roff": cell, "add": 7, "wr_id": i})
            ops.append({"op": "write", "off": 10_000 + 4096 * i, "roff": 3_000_000 + 4096 * i, "len": 4096,
                        "wr_id": 100 + i})
        ops.append({"op": "cas", "off": 64, "roff": cell, "compare": 1042, "swap": 5, "wr_id": 50})
        ops.append({"op": "cas", "off": 72, "roff": cell, "compare": 1042, "swap": 9, "wr_id": 51})
        ops.append({"op": "read", "off": 80, "roff": cell, "len": 8, "wr_id": 60})
        a.ok(cmd="post", ops=ops)
        wcs = a.ok(cmd="wait", n=len(ops), timeout=30)["wcs"]
        assert [(w["wr_id"], w["status"]) for w in wcs] == [(o["wr_id"], "SUCCESS") for o in ops], wcs
        assert [w["opcode"] for w in wcs[:2]] == ["FETCH_ADD", "RDMA_WRITE"]
        assert [w["opcode"] for w in wcs[-3:]] == ["COMP_SWAP", "COMP_SWAP", "RDMA_READ"]
        vals = a.ok(cmd="u64", off=0, n=11)["values"]
        assert vals[:6] == [1000 + 7 * i for i in range(6)]
        assert vals[8:10] == [1042, 5]                 # the first CAS swapped, the second found 5
        assert vals[10] == 5 == b.ok(cmd="u64", off=cell)["values"][0]
        assert _digest(a, 10_000, 6 * 4096) == _digest(b, 3_000_000, 6 * 4096)
        qa, qb = a.ok(cmd="query")["qp"], b.ok(cmd="query")["qp"]
        assert qa["profile"] == qb["profile"] == profile
        if profile == "native":
            na, nb = qa["native"], qb["native"]
            # eight atomics and one READ request message, each executed once by the responder
            assert nb["c_at_exec"] == 8 and na["c_at_ack_rx"] == 8 and na["c_rd_req"] == 9, (na, nb)
            assert nb["c_rd_exec"] == 1 and na["c_rd_resp_rx"] == 1, (na, nb)
    finally:
        env.release(a, b)


def test_native_read_under_loss_through_metaroced(env):
    """MR-OOO-020/021 (a missing response re-requested for just its run), MR-OOO-022 (answered from the
    responder's resource), MR-LOSS-013 (the tail of the last READ back at the RTO), MR-SACK-023 (a lost
    READ request sent again), MR-NAT-022 (a READ of more than W/2 PSNs split into request messages),
    MR-SACK-026: READs on a native QP through the daemons, responses dropped at the switch in the middle,
    twice at one PSN and at the tails, one request dropped; every byte lands in the client's memory, in
    order, and the responder sent only the re-requested responses again."""
    a, b = env.connected("native", seeds=(5, 6))
    try:
        p0 = a.ok(cmd="query")["qp"]["sq_psn"]
        sizes = [64 * 1024, 10_000, 4096, 200_000]   # PSNs +0..63, +64..73, +74..77, +78..273
        psn = [p0, p0 + 64, p0 + 74, p0 + 78]
        drops = [(x & 0xFFFFFF) for x in (p0 + 5, p0 + 5, p0 + 32, p0 + 33, p0 + 63, p0 + 77, p0 + 150, p0 + 273)]
        ops, off = [], 0
        for i, n in enumerate(sizes):
            ops.append({"op": "read", "off": off, "roff": 1_000_000 + off, "len": n, "wr_id": i})
            off += n
        with env.fabric.impair("a", opcode_filter=[OP_NATIVE_READ_RESP], psn_drop_once=drops) as fa, \
                env.fabric.impair("b", opcode_filter=[OP_NATIVE_READ_REQ], psn_drop_once=[psn[1] & 0xFFFFFF]) as fb:
            a.ok(cmd="post", ops=ops)
            wcs = a.ok(cmd="wait", n=len(ops), timeout=40)["wcs"]
            assert fa.stats()["psn_dropped"] == len(drops) and fb.stats()["psn_dropped"] == 1
        assert [(w["wr_id"], w["status"], w["byte_len"]) for w in wcs] == \
            [(i, "SUCCESS", n) for i, n in enumerate(sizes)], wcs
        assert _digest(a, 0, off) == _digest(b, 1_000_000, off)
        na, nb = a.ok(cmd="query")["qp"]["native"], b.ok(cmd="query")["qp"]["native"]
        npk = sum(-(-n // 1024) for n in sizes)
        # 196 PSNs: at least 2 messages (more where the credits cut a range short, MR-CC-002), each executed once
        assert na["c_rd_resp_rx"] == npk and na["c_rd_req"] >= len(sizes) + 1, (na, nb)
        assert nb["c_rd_exec"] == na["c_rd_req"], (na, nb)
        assert na["c_rereq"] >= 4 and nb["c_rereq_rx"] >= 4 and na["c_retx"] >= 1, (na, nb)
        assert npk + len(drops) <= nb["c_rd_resp_tx"] <= npk + 2 * len(drops) + 2, nb       # selective
    finally:
        env.release(a, b)


def test_bad_atomic_ring_entry_fails_in_the_daemons_loop(env):
    """The daemon's loop checks an atomic entry itself (the client is not trusted): one 8-byte SGE and a
    remote address that is a multiple of 8 (MR-XH-011); an entry without them completes LOC_QP_OP_ERR on
    its own QP, which goes to ERR with the reason; the client library refuses both before the ring, and an
    atomic on a QP whose connection did not agree ATOMICS (MR-CM-019)."""
    from metaroce_xdp.daemon import client as C
    from metaroce_xdp import shm
    from metaroce_xdp.verbs_types import (Access, InvalidArgument, QPAttr, QPCap, QPState, SendWR, WCStatus,
                                          WROpcode)
    with C.connect(env.sock("A"), "mr0") as c:
        pd = c.alloc_pd()
        mr = pd.reg_mr(c.alloc_buf(1 << 16), Access.LOCAL_WRITE)
        cq = c.create_cq(16)
        qp = c.create_qp(pd, cq, cq, QPCap(max_send_wr=16, max_recv_wr=16))
        qp.modify(QPAttr(qp_state=QPState.INIT))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=0x777, rq_psn=0, path_mtu=1024, dgid="10.77.0.2"))
        qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0))
        for sge, va in ((mr.sge(0, 4), 0x1000), (mr.sge(0, 8), 0x1004)):
            with pytest.raises(InvalidArgument, match="8-byte SGE"):
                qp.post_send(SendWR(wr_id=1, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[sge], remote_addr=va,
                                    rkey=1, compare_add=1))
        qp.atomics = False                  # what connect_qp/accept set when the agreed set lacks ATOMICS
        with pytest.raises(InvalidArgument, match="MR-CM-019"):
            qp.post_send(SendWR(wr_id=1, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[mr.sge(0, 8)],
                                remote_addr=0x1000, rkey=1))
        assert qp._sq[:, 0].tolist().count(0) == qp.sq_size and int(qp.W[shm.QH_SQ_TAIL]) == 0   # nothing posted
        row = (21, int(WROpcode.ATOMIC_FETCH_AND_ADD), 2, mr.addr, 8, mr.lkey, 0x1004, 1, 0, 1, 0)
        qp._sq[int(qp.W[shm.QH_SQ_TAIL]) & (qp.sq_size - 1), :len(row)] = row      # bypassing the library
        qp.W[shm.QH_SQ_TAIL] += 1
        c._doorbell(qp.qp_num)
        w = cq.wait(1, 10)[0]
        assert (w.wr_id, w.status, w.opcode.name) == (21, WCStatus.LOC_QP_OP_ERR, "FETCH_ADD"), w
        ev = c.get_async_event(5)
        assert ev.event_type == EventType.QP_FATAL and "atomic with an SGE of 8 bytes" in ev.reason and "0x1004" in ev.reason, ev

