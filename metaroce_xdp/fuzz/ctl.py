"""The control-protocol fuzzer: hostile clients of a live metaroced (harness.Daemons' A).

Each case is generated from (seed, case number) by `gen_case` as a list of steps -- plain JSON, saved with a
crash and replayed by `run_steps` -- on up to four hostile connections at once:

  raw        one datagram: truncated, oversized, deeply nested, not UTF-8, not an object, empty
  msg        a request object (a known op with hostile fields: wrong types, huge or negative ints, handles of
             the well-behaved client, unknown attributes); "$pd", "$cq", "$qp", "$mr" name this connection's
             latest handles of that kind (from the daemon's replies), "$good.<k>" the well-behaved client's
  fds        rides along with a step: none, many, a socket, a pipe, a directory, /dev/null, an eventfd, a
             non-sealed memfd, a sealed memfd with a punched hole, a tiny memfd
  close      the connection goes (abandoned: its requests may be unanswered, its objects unreleased)
  ring       a library client (client.py) with a QP in RTS writes hostile send-queue entries straight into
             its ring (local SGEs near 2^63, other lkeys, unknown opcodes) and rings the doorbell
  flood      many requests without reading a reply

After each case: the daemon runs; after each batch also: the well-behaved client's WRITE completes, the
daemon holds no more file descriptors than before the batch (once the hostile connections are gone), and
`status` shows a non-root client nothing of another's QPs.
"""
from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import fcntl
import json
import os
import random
import socket
import struct
import time

from .. import shm
from ..daemon import proto
from . import known
from .harness import batches
from .store import Finding

OPS = ("hello", "status", "open_device", "alloc_pd", "dealloc_pd", "reg_mr", "dereg_mr", "create_cq", "destroy_cq",
       "create_qp", "modify_qp", "query_qp", "destroy_qp", "stats")
FD_KINDS = ("none", "memfd", "memfd_unsealed", "memfd_hole", "memfd_tiny", "many", "socket", "pipe", "dir",
            "devnull", "eventfd")
QP_ATTRS = ("qp_state", "cur_qp_state", "path_mtu", "qp_access_flags", "dest_qp_num", "rq_psn", "sq_psn", "dgid",
            "dmac", "timeout", "retry_cnt", "rnr_retry", "min_rnr_timer", "max_rd_atomic", "max_dest_rd_atomic",
            "sport", "profile", "native_params", "traffic_class", "bogus")


# ---- values -----------------------------------------------------------------------------------------------
def hostile_int(r: random.Random) -> int:
    return r.choice([0, 1, -1, 2, 7, 255, 4096, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 40) + 1,
                     (1 << 63) - 1, 1 << 63, -(1 << 63), 1 << 64, (1 << 64) + 5, 10 ** 30, r.getrandbits(64),
                     r.randrange(-1000, 1000)])


def hostile_value(r: random.Random, depth: int = 0):
    k = r.randrange(10 if depth < 2 else 7)
    if k < 3:
        return hostile_int(r)
    if k == 3:
        return r.choice(["", "x" * r.randrange(1, 3000), "10.77.0.2", "10.77.0.99", "::1", "ff:ff:ff:ff:ff:ff", "$pd", "$qp",
                         "$good.qp", "native", "compat", "\u0000", "\udfff"[:0] + "é"])
    if k == 4:
        return r.choice([True, False, None])
    if k == 5:
        return r.choice([0.5, -0.0, 1e308, float("inf"), float("nan")])
    if k == 6:
        return r.choice(["$pd", "$cq", "$qp", "$mr", "$good.pd", "$good.cq", "$good.qp", "$good.mr"])
    if k == 7:
        return [hostile_value(r, depth + 1) for _ in range(r.randrange(4))]
    return {r.choice(QP_ATTRS): hostile_value(r, depth + 1) for _ in range(r.randrange(4))}


def hostile_msg(r: random.Random) -> dict:
    op = r.choice(OPS + ("nope", "__init__", "_serve", "", "reap"))
    m: dict = {"op": op, "id": r.choice([r.randrange(1 << 20), None, "x", [1], {"a": 1}])}
    base = {"reg_mr": {"pd": "$pd", "access": 0xF, "offset": 0, "length": 4096},
            "create_cq": {"depth": 64}, "create_qp": {"pd": "$pd", "send_cq": "$cq", "recv_cq": "$cq"},
            "modify_qp": {"qp": "$qp", "attr": {"qp_state": 2}}, "dealloc_pd": {"pd": "$pd"}, "dereg_mr": {"mr": "$mr"},
            "destroy_cq": {"cq": "$cq"}, "destroy_qp": {"qp": "$qp"}, "query_qp": {"qp": "$qp"},
            "open_device": {}}.get(op, {})
    m.update(base)
    for k in list(base) + ["ifname", "max_send_wr", "max_recv_wr", "sq_sig_all", "depth"]:
        if r.random() < 0.4:
            m[k] = hostile_value(r)
    if op == "modify_qp" and r.random() < 0.7:
        m["attr"] = {r.choice(QP_ATTRS): hostile_value(r) for _ in range(r.randrange(1, 6))}
    return m


def raw_payload(r: random.Random) -> bytes:
    k = r.randrange(9)
    if k == 0:                                                   # truncated
        d = json.dumps(hostile_msg(r)).encode()
        return d[:r.randrange(len(d))]
    if k == 1:                                                   # oversized
        return b'{"op":"status","pad":"' + b"a" * r.choice([65536, 65537, 100_000, 300_000]) + b'"}'
    if k in (2, 3):                                              # deeply nested
        n = r.choice([500, 999, 1000, 3000, 20_000, 32_000])
        if known.avoid():
            n = min(n, 800)
        o, c = r.choice([(b"[", b"]"), (b'{"a":', b"}")])
        if k == 2:
            return b'{"op":"alloc_pd","x":' + o * n + b"1" + c * n + b"}"
        return o * n
    if k == 4:
        return bytes(r.getrandbits(8) for _ in range(r.randrange(1, 200)))
    if k == 5:
        return r.choice([b"", b"null", b"[]", b"1", b'"op"', b"\xff\xfe", b'{"op":"hello"}' * 3])
    if k == 6:
        return json.dumps({"op": "hello", "id": "x" * r.randrange(60_000, 65_500)}).encode()
    if k == 7:                                                   # big number the parser must convert
        return b'{"op":"create_cq","depth":' + b"9" * r.choice([100, 4300, 5000, 60_000]) + b"}"
    return json.dumps(hostile_msg(r)).encode()


# ---- a case -------------------------------------------------------------------------------------------------
def gen_case(seed: int, case: int) -> list[dict]:
    r = random.Random(f"ctl:{seed}:{case}")
    kind = r.choices(["raw", "ops", "fds", "ring", "flood", "abandon"], [3, 4, 2, 2, 1, 1])[0]
    steps: list[dict] = []
    nconn = r.randrange(1, 5)
    prefix = [{"op": "hello"}, {"op": "open_device"}, {"op": "alloc_pd"}, {"op": "create_cq", "depth": 16}]
    if kind == "ring":
        rows = []
        for _ in range(r.randrange(1, 12)):
            rows.append({"opcode": r.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 255, -1, 1 << 40]),
                         "flags": r.choice([0, 2, 4, 6, 0xFF, -1]),
                         "laddr": r.choice(["mr", "mr+len", "mr-1", "mr_end", (1 << 63) - 4096, (1 << 63) - 1, -1,
                                            0, "good.addr", 1 << 47, r.getrandbits(63)]),
                         "length": r.choice([0, 1, 8, 4096, 65536, 1 << 31, (1 << 31) - 1, -1, (1 << 63) - 1,
                                             r.randrange(1 << 20)]),
                         "lkey": r.choice(["mr"] * 4 + ["good", 0, -1, r.getrandbits(32)]),
                         "raddr": r.choice(["good.addr", (1 << 63) - 4096, (1 << 63) - 1, -1, 0, r.getrandbits(64)]),
                         "rkey": r.choice(["good", 0, r.getrandbits(32)])})
        if known.avoid():
            for row in rows:
                for k in ("laddr", "raddr"):
                    if known.near_2_63(row[k]):
                        row[k] = "mr" if k == "laddr" else "good.addr"
        return [{"ring": rows, "dest": r.choice(["good", "random"])}]
    if kind == "flood":
        return [{"conn": 0, "msg": m} for m in prefix] + [
            {"conn": 0, "msg": {"op": r.choice(["status", "alloc_pd", "create_cq", "stats"]), "id": i},
             "noreply": True} for i in range(r.choice([50, 500, 3000]))] + [{"conn": 0, "close": True}]
    for c in range(nconn):
        if kind != "raw" or r.random() < 0.5:
            steps += [{"conn": c, "msg": m} for m in prefix]
            if r.random() < 0.5:
                steps.append({"conn": c, "msg": {"op": "create_qp", "pd": "$pd", "send_cq": "$cq", "recv_cq": "$cq",
                                                 "max_send_wr": 4, "max_recv_wr": 4}})
    for _ in range(r.randrange(1, 25)):
        c = r.randrange(nconn)
        if kind == "raw":
            st = {"conn": c, "raw": raw_payload(r).hex()}
        elif kind == "fds":
            st = {"conn": c, "msg": {"op": "reg_mr", "pd": "$pd", "access": r.randrange(16),
                                     "offset": r.choice([0, 0, 4095, 4096, 1 << 20, -1, (1 << 63) - 1]),
                                     "length": r.choice([1, 4096, 1 << 20, 1 << 21, 1 << 40, 0])},
                  "fds": r.choice(FD_KINDS)}
        else:
            st = {"conn": c, "msg": hostile_msg(r)}
            if r.random() < 0.2:
                st["fds"] = r.choice(FD_KINDS)
        if kind == "abandon" and r.random() < 0.5:
            st["noreply"] = True
        steps.append(st)
    if kind == "abandon":
        steps += [{"conn": c, "close": True} for c in range(nconn) if r.random() < 0.5]
    rq = random.Random(f"ctl-qp:{seed}:{case}")          # a stream of its own: the rest of the case as it was
    if kind == "ops" and rq.random() < 0.3:
        # a QP through INIT to RTR with hostile path attributes (a neighbour that never answers: N1)
        c = rq.randrange(nconn)
        steps += [{"conn": c, "msg": {"op": "create_qp", "pd": "$pd", "send_cq": "$cq", "recv_cq": "$cq",
                                      "max_send_wr": 4, "max_recv_wr": 4}},
                  {"conn": c, "msg": {"op": "modify_qp", "qp": "$qp", "attr": {"qp_state": 1, "qp_access_flags": 15}}},
                  {"conn": c, "msg": {"op": "modify_qp", "qp": "$qp", "attr": {
                      "qp_state": 2, "dest_qp_num": rq.choice([0, 1, "$good.qpn", rq.getrandbits(24)]),
                      "rq_psn": rq.getrandbits(24), "path_mtu": rq.choice([1024, 1024, 1024, 256, 4096, 0, 3]),
                      "dgid": rq.choice(["10.77.0.2", "10.77.0.99", "10.77.0.255", "10.77.0.0", "fd77::2", "fe80::1",
                                         "::ffff:10.77.0.2", "10.77.0.2%mr0", "1.2.3.4"]),
                      "max_dest_rd_atomic": rq.choice([1, 1, 4, 0, 16, 255]), "min_rnr_timer": rq.randrange(32)}}}]
        if known.avoid() and steps[-1]["msg"]["attr"]["dgid"] == "10.77.0.99":
            steps[-1]["msg"]["attr"]["dgid"] = "10.77.0.2"
    return steps


# ---- fds --------------------------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
FALLOC_PUNCH = 0x02 | 0x01                  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def make_fds(kind: str | None) -> list[int]:
    if kind in (None, "none"):
        return []
    if kind == "memfd":
        return [shm.create(1 << 20, "fz")]
    if kind == "memfd_unsealed":
        fd = os.memfd_create("fz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1 << 20)
        return [fd]
    if kind == "memfd_hole":
        fd = shm.create(1 << 21, "fz")
        os.pwrite(fd, b"\x55" * 8192, 0)
        _libc.fallocate(fd, FALLOC_PUNCH, ctypes.c_long(0), ctypes.c_long(1 << 20))
        return [fd]
    if kind == "memfd_tiny":
        fd = os.memfd_create("fz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, shm.SEALS)
        return [fd]
    if kind == "many":
        return [shm.create(4096, "fz") for _ in range(6)]
    if kind == "socket":
        a, b = socket.socketpair()
        b.close()
        return [a.detach()]
    if kind == "pipe":
        rd, wr = os.pipe()
        os.close(wr)
        return [rd]
    if kind == "dir":
        return [os.open("/", os.O_RDONLY | os.O_DIRECTORY)]
    if kind == "devnull":
        return [os.open("/dev/null", os.O_RDWR)]
    if kind == "eventfd":
        return [os.eventfd(0)]
    raise ValueError(kind)


# ---- running a case -----------------------------------------------------------------------------------------------
class Conn:
    def __init__(self, path: str) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.s.settimeout(STALL_S + 3.0)
        self.s.connect(path)
        self.h: dict[str, int] = {}
        self.fds: list[int] = []

    def sub(self, v, good: dict):
        if isinstance(v, str) and v.startswith("$"):
            k = v[1:]
            if k.startswith("good."):
                return good.get(k[5:], 0)
            return self.h.get(k, 0)
        if isinstance(v, dict):
            return {k: self.sub(x, good) for k, x in v.items()}
        if isinstance(v, list):
            return [self.sub(x, good) for x in v]
        return v

    def send(self, data: bytes, fds: list[int]) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        self.s.sendmsg([data], anc)

    def reply(self) -> dict | None:
        try:
            msg, fds, _ = proto.recv(self.s, proto.MAX_REPLY)
        except (socket.timeout, OSError):
            return None
        self.fds += fds
        if isinstance(msg, dict):
            for k in ("pd", "cq", "qp", "mr"):
                if isinstance(msg.get(k), int):
                    self.h[k] = msg[k]
        return msg

    def close(self) -> None:
        self.s.close()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode("utf-8", "surrogatepass")


STALL_S = 1.5                  # a reply later than this: the daemon's one control thread was blocked for everyone


def run_steps(d, steps: list[dict]) -> str | None:
    """Run one case against daemon A of `d` (harness.Daemons); what the hostile client saw go wrong on its side
    that matters -- a request whose answer took longer than STALL_S (None: nothing)."""
    slow = None
    good = d.good_handles() if d.good else {}
    conns: dict[int, Conn] = {}
    try:
        for st in steps:
            if "ring" in st:
                run_ring(d, st, good)
                continue
            c = st["conn"]
            if st.get("close"):
                if c in conns:
                    conns.pop(c).close()
                continue
            if c not in conns:
                try:
                    conns[c] = Conn(d.sock("A"))
                except OSError:
                    return None                        # the daemon is gone (alive() says how) or refuses
            conn = conns[c]
            data = bytes.fromhex(st["raw"]) if "raw" in st else _json(conn.sub(st["msg"], good))
            fds = make_fds(st.get("fds"))
            sent = False
            try:
                conn.send(data, fds)
                sent = True
            except TimeoutError:
                # the daemon reads no request of a client whose replies wait in its outbox (a client that does not
                # read costs itself only): this connection is back-pressured; others must still be served
                dt = probe(d) if slow is None and d.alive("A")[0] else 0.0
                if dt is None or dt > STALL_S:
                    slow = (f"a client's sends blocked and another client's hello was answered after "
                            f"{'no reply' if dt is None else f'{dt:.1f} s'}: {json.dumps(st)[:300]}")
                conns.pop(c).close()
                continue
            except OSError as e:                    # too large for one datagram, or the daemon dropped us
                if e.errno not in (errno.EMSGSIZE, errno.EPIPE, errno.ECONNRESET, errno.ENOBUFS, errno.EAGAIN,
                                   errno.ETOOMANYREFS):
                    raise
            finally:
                for fd in fds:
                    os.close(fd)
            if sent and not st.get("noreply"):
                # A request may wait for its own answer (an RTR whose peer's MAC is unknown waits on a thread of
                # its own, up to 2 s: N1's fix); a stall is the control thread not answering anyone else meanwhile.
                conn.s.settimeout(STALL_S)
                got = conn.reply()
                conn.s.settimeout(STALL_S + 3.0)
                if got is None and slow is None and d.alive("A")[0]:
                    dt = probe(d)
                    if dt is None or dt > STALL_S:
                        slow = (f"another client's hello was answered after "
                                f"{'no reply' if dt is None else f'{dt:.1f} s'} while this request waited "
                                f"(the control thread was blocked): {json.dumps(st)[:300]}")
                    conn.reply()                        # the rest of its own wait
    finally:
        for conn in conns.values():
            conn.close()
    return slow


def probe(d) -> float | None:
    """Seconds a fresh client waits for the answer to a hello (None: no answer within STALL_S + 3 s)."""
    try:
        c = Conn(d.sock("A"))
    except OSError:
        return None
    try:
        t0 = time.monotonic()
        c.send(_json({"op": "hello", "id": 1}), [])
        return time.monotonic() - t0 if c.reply() is not None else None
    except OSError:
        return None
    finally:
        c.close()


def run_ring(d, st: dict, good: dict) -> None:
    """A library client's QP in RTS (towards B's well-behaved QP, or a QPN nobody has) writes hostile entries."""
    from ..daemon import client
    from ..verbs_types import QPAttr, QPCap, QPState
    from .harness import FULL
    try:
        ctx = client.connect(d.sock("A")).open_device()
    except Exception:                                        # noqa: BLE001 - the daemon is gone or refuses
        return
    try:
        pd = ctx.alloc_pd()
        buf = ctx.alloc_buf(1 << 16)
        mr = pd.reg_mr(buf, FULL)
        cq = ctx.create_cq(64)
        qp = ctx.create_qp(pd, cq, cq, QPCap(max_send_wr=16, max_recv_wr=4))
        bq = d.good["B"][5].qp_num if st["dest"] == "good" else 0xABCDE
        qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=bq, rq_psn=0, path_mtu=1024, dgid=d.pair.b.ipv4,
                         max_dest_rd_atomic=4, min_rnr_timer=1))
        qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0, timeout=8, retry_cnt=1, rnr_retry=1, max_rd_atomic=4))
        vals = {"mr": mr.addr, "mr+len": mr.addr + mr.length, "mr-1": mr.addr - 1, "mr_end": mr.addr + mr.length - 8,
                "good.addr": good.get("addr", 0)}
        keys = {"mr": mr.lkey, "good": good.get("lkey", 0)}
        rkeys = {"good": d.good["B"][3].rkey if d.good else 0}
        v = qp._v
        base = 8 * shm.QH_WORDS
        tail = v[shm.QH_SQ_TAIL]
        for i, row in enumerate(st["ring"][:qp.sq_size]):
            w = [i, row["opcode"], row["flags"], vals.get(row["laddr"], row["laddr"]), row["length"],
                 keys.get(row["lkey"], row["lkey"]), vals.get(row["raddr"], row["raddr"]),
                 rkeys.get(row["rkey"], row["rkey"]), 0, 0, 0]
            w = [((x & 0xFFFFFFFFFFFFFFFF) ^ (1 << 63)) - (1 << 63) for x in w]
            struct.pack_into(f"<{len(w)}q", qp._mm, base + 8 * shm.SQE_WORDS * ((tail + i) & (qp.sq_size - 1)), *w)
        v[shm.QH_SQ_TAIL] = tail + min(len(st["ring"]), qp.sq_size)
        ctx._doorbell(qp.qp_num)
        time.sleep(0.3)
        with contextlib.suppress(Exception):
            cq.poll(64)
    except Exception:                                        # noqa: BLE001 - refusals are the daemon doing its job
        pass
    finally:
        with contextlib.suppress(Exception):
            ctx.close()


# ---- checks between batches ---------------------------------------------------------------------------------------
def status_leak(d) -> str | None:
    """Finding 4: a client that is not root sees other clients' QPs in `status`.  The fuzzer runs as root, so it
    asks as uid 65534 from a child (the socket is 0666)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(5)
            s.connect(d.sock("A"))
            proto.send(s, {"op": "status", "id": 1})
            msg, _, _ = proto.recv(s, proto.MAX_REPLY)
            os.write(w, json.dumps(msg or {}).encode()[:1 << 20])
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        data += b
    os.close(r)
    os.waitpid(pid, 0)
    try:
        msg = json.loads(data or b"{}")
    except ValueError:
        return None
    qps = msg.get("qps") or []
    if msg.get("ok") and qps:
        q = qps[0]
        return (f"status answered uid 65534 (no QP of its own) with {len(qps)} QPs of other clients, e.g. "
                f"{ {k: q.get(k) for k in list(q)[:8]} }")
    return None


RSS_GROWTH = 64 << 20          # the daemon's memory may grow this much in one batch (its hostile clients all gone)


def after_batch(d, seed: int, case: int, fd_base: int, what: list, rss_base: int = -1) -> list[Finding]:
    out: list[Finding] = []
    ok, why = d.alive("A")
    if not ok:
        return out                                # the case that killed it is recorded by run()
    t0 = time.monotonic()
    err = d.good_write()
    dt = time.monotonic() - t0
    if err:
        out.append(Finding("ctl", seed, case, "hang", err, "", {"batch": what}))
    elif dt > 5:
        out.append(Finding("ctl", seed, case, "hang", f"well-behaved WRITE took {dt:.1f} s after the batch", "",
                           {"batch": what}))
    time.sleep(0.3)
    n = d.fds("A")
    if fd_base > 0 and n > fd_base + 8:
        out.append(Finding("ctl", seed, case, "leak", f"metaroced holds {n} fds after the batch, {fd_base} before "
                           "(hostile connections all closed)", "", {"batch": what}))
    m = d.rss("A")
    if rss_base > 0 and m - rss_base > RSS_GROWTH:
        out.append(Finding("ctl", seed, case, "leak", f"metaroced's RSS grew from {rss_base >> 20} to {m >> 20} MiB "
                           "in one batch (hostile connections all closed)", "", {"batch": what}))
    return out


def run(d, seed: int, cases: range | list[int], batch: int = 8, deadline: float | None = None,
        log=lambda line: print(line, flush=True)) -> tuple[list[Finding], dict]:
    """Cases of `seed` against d's daemon A; a crash restarts both daemons and the run goes on.  Returns the
    findings (crashes, hangs, leaks, the status leak) and counts."""
    found: list[Finding] = []
    stats = {"cases": 0, "steps": 0, "crashes": 0, "hangs": 0, "restarts": 0}
    leak = status_leak(d)
    if leak:
        found.append(Finding("ctl", seed, -1, "leak", leak, "", {"op": "status", "uid": 65534}))

    def restarted(f: Finding, kind: str) -> None:          # a finding that cost the daemon: start it again
        found.append(f)
        stats[kind] += 1
        log(f.line())
        d.restart()
        stats["restarts"] += 1

    for chunk in batches(cases, batch, deadline):
        fd_base, rss_base = d.fds("A"), d.rss("A")
        for c in chunk:
            steps = gen_case(seed, c)
            stats["cases"] += 1
            stats["steps"] += len(steps)
            slow = None
            try:
                slow = run_steps(d, steps)
            except Exception as e:                   # noqa: BLE001 - a fuzzer bug, not the daemon's; say so
                log(f"ctl: case {c}: the fuzzer itself failed: {type(e).__name__}: {e}")
            if slow and d.alive("A", wait=3.0)[0]:       # not a daemon on its way out (it drains first)
                f = Finding("ctl", seed, c, "hang", slow, describe(steps), {"steps": steps})
                found.append(f)
                stats["hangs"] += 1
                log(f.line())
            time.sleep(0.05)
            ok, why = d.alive("A")
            if ok:
                t0 = time.monotonic()
                err = d.good_write(timeout=4.0)
                dt = time.monotonic() - t0
                if err or dt > 2.0:
                    ok, why = d.alive("A", wait=8.0)          # stopping (an uncaught exception drains first)?
                if (err or dt > 2.0) and ok:
                    restarted(Finding("ctl", seed, c, "hang", err or f"well-behaved WRITE took {dt:.1f} s after the "
                                      "case", describe(steps), {"steps": steps}), "hangs")
                    fd_base = -1
                    continue
            if not ok:
                restarted(Finding("ctl", seed, c, "crash", why.splitlines()[0] + " " + _last_exc(why),
                                  describe(steps) + "\n" + why, {"steps": steps}), "crashes")
                fd_base = -1
        for f in after_batch(d, seed, chunk[-1], fd_base, chunk, rss_base if fd_base > 0 else -1):
            found.append(f)
            stats["hangs" if f.kind == "hang" else "leaks"] = stats.get("hangs" if f.kind == "hang" else "leaks", 0) + 1
            log(f.line())
            if f.kind == "hang":
                d.restart()
                stats["restarts"] += 1
    return found, stats


def describe(steps: list[dict]) -> str:
    """What a case did, for the signatures of known.py: its kinds of step, and a ring aimed at the well-behaved
    client's peer QP (a second QP with the same (dgid, dest_qp): finding 4)."""
    kinds = set()
    for st in steps:
        if "ring" in st:
            kinds.add(f"ring dest={st['dest']}")
            for row in st["ring"]:
                for k in ("laddr", "raddr"):
                    if known.near_2_63(row[k]):
                        kinds.add(f"ring {k} near-2^63")
        elif "raw" in st:
            kinds.add("raw")
        elif "msg" in st:
            kinds.add(f"op {st['msg'].get('op')!s:.20}")
        if st.get("fds"):
            kinds.add(f"fds {st['fds']}")
        if st.get("noreply"):
            kinds.add("noreply")
    return "case: " + ", ".join(sorted(kinds))


def _last_exc(text: str) -> str:
    """The exception line of the last traceback in a log tail: its last unindented line."""
    lines = text.splitlines()
    start = max((i for i, ln in enumerate(lines) if ln.startswith("Traceback")), default=None)
    if start is None:
        return ""
    tail = [ln for ln in lines[start + 1:] if ln and not ln.startswith(" ") and not ln.startswith("During handling")]
    return tail[-1].strip()[:300] if tail else ""
