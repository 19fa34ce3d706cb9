"""`metaroce pingpong`: rdma-core's ibv_rc_pingpong, on a MetaRoCE endpoint.

    metaroce pingpong -d mr1 -g 1                 # server: waits on TCP 18515
    metaroce pingpong -d mr0 -g 1 10.77.0.2       # client

Interoperates with `ibv_rc_pingpong -g <idx>` on Soft-RoCE or an RDMA NIC (spec
06-connection.md section 6.7, MR-CM-040..046): same options and defaults, the
same 52-byte text exchange (metaroce_xdp/cm.py), the same fixed QP attributes,
the same traffic and the same closing lines.  The traffic, as in rc_pingpong.c:
both sides keep RX_DEPTH receives posted (reposting when at most one is left),
the client posts the first SEND; a side posts its next SEND once both its
previous SEND and a RECV have completed; each side stops when it has completed
ITERS sends and ITERS receives.  One buffer serves both directions.

-g is accepted for compatibility and does not select anything: the endpoint has
one GID, its interface's IP address.  When the peer sends an all-zero GID
(ibv_rc_pingpong without -g) the TCP peer address is used instead.

Engine: metaroced when one serves the interface (metaroce_xdp/cli/engine_choice.py: its socket answers a
`status` request listing the interface, in this network namespace), the in-process engine otherwise
or with --no-daemon; which one ran is said on stderr (stdout stays rc_pingpong's).  The in-process
engine is the compiled data plane (metaroce_xdp.dp, the endpoint applications get).  Either way the QP
is a compat one: the text exchange carries no capabilities, so the traffic is plain RoCEv2.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from metaroce_xdp import cm
from metaroce_xdp.verbs_types import wc_failure

from . import engine_choice
from .perf import PLANES, open_context

RECV_WRID = 1                      # PINGPONG_RECV_WRID
SEND_WRID = 2                      # PINGPONG_SEND_WRID
# rc_pingpong.c pp_connect_ctx: fixed attributes (MR-CM-044)
MAX_DEST_RD_ATOMIC = 1
MIN_RNR_TIMER = 12
TIMEOUT = 14
RETRY_CNT = 7
RNR_RETRY = 7
MAX_RD_ATOMIC = 1


class PingpongError(Exception):
    """The pingpong could not run; the message says what to do."""


@dataclass
class PingpongOptions:
    ifname: str
    server: str | None = None
    port: int = cm.CM_PORT
    size: int = 4096
    mtu: int = 1024
    rx_depth: int = 500
    iters: int = 1000
    gid_idx: int = -1
    timeout: float = 60.0          # seconds without progress before giving up (rc_pingpong waits forever)
    no_daemon: bool = False        # never use metaroced, even when it serves the interface
    socket: str | None = None      # metaroced's control socket (default: engine_choice's search)
    plane: str = "compiled"        # the in-process data plane: "compiled" (metaroce_xdp.dp), the only one


def address_line(label: str, d: cm.PingpongDest) -> str:
    """rc_pingpong.c: "  local address:  LID 0x%04x, QPN 0x%06x, PSN 0x%06x, GID %s"."""
    return "  %s LID 0x%04x, QPN 0x%06x, PSN 0x%06x, GID %s" % (label, d.lid, d.qpn, d.psn, cm.gid_text(d.gid))


def closing_lines(size: int, iters: int, usec: float) -> list[str]:
    """rc_pingpong.c's summary; usec is a C float there, so round it the same way."""
    usec = float(np.float32(usec))
    nbytes = size * iters * 2
    return ["%d bytes in %.2f seconds = %.2f Mbit/sec" % (nbytes, usec / 1e6, nbytes * 8.0 / usec if usec else 0.0),
            "%d iters in %.2f seconds = %.2f usec/iter" % (iters, usec / 1e6, usec / iters if iters else 0.0)]


def summary(res: dict) -> dict:
    """`metaroce pingpong --json`: run()'s result as one JSON-ready object (schema metaroce-pingpong/1)."""
    def dest(d) -> dict:
        return {"lid": d.lid, "qpn": d.qpn, "psn": d.psn, "gid": cm.gid_text(bytes(d.gid))}
    usec = res["usec"]
    return {"schema": "metaroce-pingpong/1", "local": dest(res["local"]), "remote": dest(res["remote"]),
            "bytes": res["bytes"], "iters": res["iters"], "seconds": usec / 1e6,
            "mbit_per_s": res["bytes"] * 8.0 / usec if usec else 0.0,
            "usec_per_iter": usec / res["iters"] if res["iters"] else 0.0,
            "engine": res["engine"], "plane": res["plane"]}


def run(opt: PingpongOptions, out: TextIO = sys.stdout) -> dict:
    if opt.mtu not in cm.MTU_ENUM:
        raise PingpongError(f"-m {opt.mtu}: the path MTU must be one of {sorted(cm.MTU_ENUM)}")
    if opt.size < 0 or opt.rx_depth < 2 or opt.iters < 1:
        raise PingpongError("need -s >= 0, -r >= 2 and -n >= 1")
    if opt.plane not in PLANES:
        raise PingpongError(f"--plane {opt.plane}: use one of {', '.join(PLANES)}")
    try:
        from metaroce_xdp.verbs_types import (SGE, Access, QPAttr, QPCap, QPState, RecvWR, SendFlags, SendWR,
                                              VerbsError, WCStatus, WROpcode)
    except Exception as e:  # noqa: BLE001
        raise PingpongError(f"cannot load the engine: {e}") from None
    choice = engine_choice.choose(opt.ifname, opt.socket, opt.no_daemon)
    engine_choice.say("metaroce pingpong", engine_choice.Choice(choice.socket, choice.why if choice.daemon else
                                                                  f"{choice.why}, the compiled plane"))
    try:
        ctx = (engine_choice.open_daemon_context(choice, opt.ifname) if choice.daemon
               else open_context(opt.ifname))
    except Exception as e:  # noqa: BLE001 - tool boundary: one clear line
        raise PingpongError(f"IB device {opt.ifname} not usable: {e} (run as root in the interface's network "
                            "namespace; list interfaces with `ip link`)") from None
    try:
        # what drives the in-process engine: the compiled plane's Context (metaroced runs by itself)
        eng = None if choice.daemon else ctx
        max_pmtu = ctx.max_pmtu if eng is None else eng.max_pmtu
        if opt.mtu > max_pmtu:
            raise PingpongError(f"-m {opt.mtu}: {opt.ifname} carries at most {max_pmtu}")
        # pp_init_ctx: buffer filled with 0x7b, MR with LOCAL_WRITE, CQ of rx_depth + 1,
        # QP with one send WR and rx_depth receives, INIT with no remote access.
        if choice.daemon:                 # memory the daemon can reach: a shared buffer
            buf = ctx.alloc_buf(max(opt.size, 1))
            buf[:] = 0x7B
        else:
            buf = np.full(max(opt.size, 1), 0x7B, np.uint8)
        pd = ctx.alloc_pd()
        mr = pd.reg_mr(buf, Access.LOCAL_WRITE)
        cq = ctx.create_cq(opt.rx_depth + 1)
        qp = ctx.create_qp(pd, cq, cq, QPCap(max_send_wr=1, max_recv_wr=opt.rx_depth, max_send_sge=1,
                                             max_recv_sge=1))
        qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=Access(0)))
        sge = [SGE(mr.addr, opt.size, mr.lkey)] if opt.size else []
        rwr = RecvWR(RECV_WRID, sge)
        swr = SendWR(SEND_WRID, WROpcode.SEND, sge, send_flags=SendFlags.SIGNALED)

        def post_recv(n: int) -> int:
            try:
                qp.post_recv([rwr] * n)
            except VerbsError:
                return 0
            return n

        routs = post_recv(opt.rx_depth)
        if routs < opt.rx_depth:
            raise PingpongError(f"Couldn't post receive ({routs})")

        mine = cm.PingpongDest(0, qp.qp_num, cm.random_psn(), cm.ip_to_gid(ctx.gid))

        def connect_qp(dest: cm.PingpongDest, tcp_peer: str) -> None:
            # pp_connect_ctx; a zero GID means the peer ran without -g: use its TCP address.
            dgid = tcp_peer if dest.gid == bytes(16) else cm.gid_to_ip(dest.gid)
            try:
                qp.modify(QPAttr(qp_state=QPState.RTR, path_mtu=opt.mtu, dest_qp_num=dest.qpn, rq_psn=dest.psn,
                                 dgid=dgid, max_dest_rd_atomic=MAX_DEST_RD_ATOMIC, min_rnr_timer=MIN_RNR_TIMER))
                qp.modify(QPAttr(qp_state=QPState.RTS, timeout=TIMEOUT, retry_cnt=RETRY_CNT, rnr_retry=RNR_RETRY,
                                 sq_psn=mine.psn, max_rd_atomic=MAX_RD_ATOMIC))
            except VerbsError as e:
                raise PingpongError(f"Couldn't connect to remote QP: {e}") from None

        listener = cm.Listener(opt.port) if opt.server is None else None   # listen before announcing
        out.write(address_line("local address: ", mine) + "\n")
        out.flush()
        try:
            if opt.server is not None:
                ch = cm.connect(opt.server, opt.port)
                with ch:
                    rem = cm.pp_client_exchange(ch, mine)
                peer_ip = ch.peer.rsplit(":", 1)[0]
            else:
                with listener:
                    ch = listener.accept(None)
                with ch:
                    rem = cm.pp_server_exchange(ch, mine, lambda d: connect_qp(d, ch.peer))
                peer_ip = ch.peer
        except cm.ConnectFailed as e:
            raise PingpongError(f"Couldn't connect to {opt.server}:{opt.port}: {e}") from None
        except cm.CMError as e:
            raise PingpongError(f"Couldn't exchange addresses: {e}") from None
        out.write(address_line("remote address:", rem) + "\n")
        out.flush()
        if opt.server is not None:
            connect_qp(rem, peer_ip)

        pending = RECV_WRID
        if opt.server is not None:
            qp.post_send(swr)
            pending |= SEND_WRID
        start = time.time()
        rcnt = scnt = 0
        iters = opt.iters
        last_progress = time.monotonic()
        idle = 0
        while rcnt < iters or scnt < iters:
            wcs = cq.poll(2)
            if not wcs:
                idle += 1
                if choice.daemon:
                    os.sched_yield()      # the daemon's threads may need this CPU to deliver it
                if not idle & 1023 and time.monotonic() - last_progress > opt.timeout:
                    raise PingpongError(f"no completion for {opt.timeout:g}s (scnt={scnt}, rcnt={rcnt}): "
                                        "is the peer still running?")
                continue
            idle = 0
            last_progress = time.monotonic()
            for wc in wcs:                                                   # parse_single_wc
                if wc.status != WCStatus.SUCCESS:
                    raise PingpongError(f"Failed status {wc.status.name} ({int(wc.status)}) for wr_id {wc.wr_id}: "
                                        + wc_failure(wc, qp.query().get("error")))
                if wc.wr_id == SEND_WRID:
                    scnt += 1
                elif wc.wr_id == RECV_WRID:
                    routs -= 1
                    if routs <= 1:
                        routs += post_recv(opt.rx_depth - routs)
                        if routs < opt.rx_depth:
                            raise PingpongError(f"Couldn't post receive ({routs})")
                    rcnt += 1
                else:
                    raise PingpongError(f"Completion for unknown wr_id {wc.wr_id}")
                pending &= ~wc.wr_id
                if scnt < iters and not pending:
                    qp.post_send(swr)
                    pending = RECV_WRID | SEND_WRID
        end = time.time()
        usec = (end - start) * 1e6
        # the final ACK of our last SEND may still sit in the engine: one more round sends it
        # (metaroced keeps running: it sends it by itself)
        for _ in range(0 if eng is None else 8):
            eng.progress()
        for line in closing_lines(opt.size, iters, usec):
            out.write(line + "\n")
        out.flush()
        return {"local": mine, "remote": rem, "usec": usec, "bytes": opt.size * iters * 2, "iters": iters,
                "engine": "metaroced" if choice.daemon else "in-process", "plane": None if choice.daemon else "compiled"}
    finally:
        ctx.close()


__all__ = ["PingpongError", "PingpongOptions", "run", "address_line", "closing_lines"]
