"""The native profile in the compiled data plane, part 4 of 4: what dp/round.py calls -- `nat_rx` (a native
QP's frame: requests placed out of order by RSN/MSN, SACKs, READ responses, ATOMIC_ACKNOWLEDGEs) and
`nat_qp` (a native QP's share of the round: requester, timers, READ jobs, owed SACKs) -- and
`NativeSlots`, the Python side that gives a QP its slot at RTR and starts it at RTS.

The profile is chosen at RTR (QPAttr.profile; dp/cmconnect.py negotiates it).
"""
from __future__ import annotations

import numpy as np
from numba import njit
from .. import jitcache  # noqa: F401  (cache keyed on every module compiled code depends on)

from ..dp.layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from . import layout as NL
from ..congestion import link_rate_bps
from ..dp.cc import ce_marked
from ..dp.clientq import late_recvs
from ..dp.core import (ACC_REMOTE_WRITE, AETH_ACK_SYN, NAK_INV_REQ, NAK_REM_ACCESS, NAK_REM_OP, OP_ATOMIC_ACK, OP_CAS,
                       OP_FAA, RNR_SYN, ST_ERR, ST_RTR, ST_RTS, ST_SQD, ST_SQE, activate, flush_queues, mr_check,
                       mr_live_a, place, sg_valid)
from ..dp.layout import PSN_MASK
from ..dp.prims import ld_acq_i64
from ..dp.reasons import (WHY_IMMDT_DIFFERS, WHY_PAYLOAD_LENGTH, WHY_RECV_MR_INVALID, WHY_REMOTE_ACCESS,
                          WHY_RSN_INVALID, WHY_SEND_TOO_LONG)
from ..dp.requester import fail_local, sqd_check
from ..verbs_types import Unsupported
from ..wire.headers import UDP, IPv6
from ..wire.hdr import (IP4_ADDR_SIZE, IP4_SIZE, IP6_ADDR_SIZE, IP6_SIZE, O_IP4_DST, O_IP4_SRC, O_IP6_DST,
                        O_IP6_SRC, OPT, OT_IMMDT, OT_NETH, OT_PAY, OT_RETH, OT_RSNETH, bth_ackreq, bth_se, ext_at,
                        immdt_imm, neth_flags, neth_msg_len, neth_msn, neth_offset, neth_tsval, put_field, reth_dlen,
                        reth_rkey, reth_va, rsneth_rsn, udp_of, udp_sport)
from .multipath import entropy_context, entropy_values, flow_label_key, mp_init
from .rdpace import NRP, RP_C_PACED, RP_C_SHARED, RP_C_WAIT, RP_PEND, RP_SHARE, RP_SHARE_MIN
from .receiver import (RSN_INVALID, RSN_NOT_READY, RX_NEW, RX_OOW, RX_SACK_NOW, rx_init, rx_on_not_ready, rx_on_packet,
                       rx_recorded, rx_rsn_check)
from .sender import tx_init
from .plane_slot import (EXT_BYTES, NETH_FIRST, NETH_LAST, NNX, NPW, NRMX, NSLOT, NX_FIELDS, OP_N_READ_REQ,
                         OP_N_READ_RESP, OP_N_SACK, OP_N_SEND, OP_N_SEND_IMM, OP_N_WRITE, OP_N_WRITE_IMM, O_LM, O_LR,
                         O_NX, O_PAR, O_PT, O_RM, O_RMX, O_RP, O_RX, O_SP, O_TX, O_TXR, PW_NPEND, PW_RATE, P_NAT_EXT,
                         P_NAT_OFF, SLOT_WORDS, X_C_BAD_LEN, X_C_DUP, X_C_ERR_HELD, X_C_IMM_INV, X_C_NOTREADY, X_C_OOO,
                         X_C_OOW, X_C_PLACED, X_C_RSN_INV, X_C_RX_BYTES, X_ERR_PSN, X_ERR_SYN, X_FL_KEY, X_JB_HEAD,
                         X_JB_TAIL, X_RD_GAP, X_RS_HELD, X_SACK_OWED, _jit, flow_label, nat_advanced,
                         nat_error_due, nat_rd_pend, nat_reject, nat_send_sack, nat_slot, rows, slot_base)
from .plane_read import nat_on_atomic_ack, nat_on_read_resp, nat_rd_execute, nat_rd_send, nat_rd_timers, nat_rx_rd
from .plane_tx import nat_on_sack, nat_requester, nat_timers

_jit = dict(cache=True, nogil=True)

MSG_MAX = 1 << 31                # the largest Message Length (MR-XH-020)
DEFAULT_READ_RATE_BPS = 10e9     # when the interface does not tell its speed (as DCQCN's R_line)


@njit(**_jit)
def nat_rx(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, qi, op, psn, bo, end, pad, l3, now):
    """One native packet of QP qi (ICRC checked; bo = BTH offset, end = ICRC offset): a SACK for the
    requester, or a NATIVE_SEND/SEND_IMM/WRITE/WRITE_IMM request, placed where NETH.offset and the
    RETH or the RSN's receive WQE say whatever its order (MR-OOO-001..014), recorded in the receive
    window (MR-SACK-010..017), completed in order, SACKed on gaps, duplicates, AckReq and every
    ack_n packets."""
    sl = nat_slot(A, qi)
    b = slot_base(A, sl)
    st = Q[qi, Q_STATE]
    if op == OP_N_SACK:
        if st != ST_RTS and st != ST_SQD and st != ST_SQE:
            A[P_RX_DROP_STATE] += 1
            return
        nat_on_sack(A, Q, SW, CQT, CE, umem, qi, b, psn, bo, end, now)
        activate(A, Q, qi)
        return
    if op == OP_N_READ_RESP or op == OP_ATOMIC_ACK:  # the requester's READ responses and atomic results
        if st != ST_RTS and st != ST_SQD and st != ST_SQE:
            A[P_RX_DROP_STATE] += 1
            return
        if op == OP_N_READ_RESP:
            nat_on_read_resp(A, Q, SW, CQT, CE, umem, qi, b, psn, bo, end, pad, 1 if ce_marked(umem, l3) else 0,
                             now)
        else:
            nat_on_atomic_ack(A, Q, SW, CQT, CE, umem, qi, b, psn, bo, end, pad, now)
        activate(A, Q, qi)
        return
    if op == OP_N_READ_REQ or op == OP_CAS or op == OP_FAA:
        if (st != ST_RTR and st != ST_RTS and st != ST_SQD) or Q[qi, Q_FNAK_SYN]:
            A[P_RX_DROP_STATE] += 1
            return
        nat_rx_rd(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, qi, b, op, psn, bo, end, pad, l3, st, now)
        activate(A, Q, qi)
        return
    if op < OP_N_SEND or op > OP_N_WRITE_IMM:
        A[P_RX_DROP_OP] += 1                         # MR-NAT-007
        return
    if (st != ST_RTR and st != ST_RTS and st != ST_SQD) or Q[qi, Q_FNAK_SYN]:
        A[P_RX_DROP_STATE] += 1
        return
    par, rx, s, nx, sb, pt = rows(A, b)
    h = bo + OPT[op, OT_PAY]                         # the payload
    is_write = op >= OP_N_WRITE
    recv = op != OP_N_WRITE
    has_imm = op == OP_N_SEND_IMM or op == OP_N_WRITE_IMM
    va = np.int64(0)
    rkey = np.int64(0)
    dlen = np.int64(-1)
    if h + pad > end:
        nx[X_C_BAD_LEN] += 1
        A[P_RX_DROP_LEN] += 1                        # MR-NAT-009, MR-XH-039
        return
    if is_write:
        t = ext_at(bo, op, OT_RETH)
        va = reth_va(umem, t)
        rkey = reth_rkey(umem, t)
        dlen = reth_dlen(umem, t)
    t = ext_at(bo, op, OT_NETH)
    fl = neth_flags(umem, t)
    msn = neth_msn(umem, t)
    off = neth_offset(umem, t)
    mlen = neth_msg_len(umem, t)
    tsval = neth_tsval(umem, t)
    rsn = np.int64(0)
    if recv:
        rsn = rsneth_rsn(umem, ext_at(bo, op, OT_RSNETH))
    imm = np.int64(0)
    if has_imm:
        imm = immdt_imm(umem, ext_at(bo, op, OT_IMMDT))
    plen = end - pad - h
    pmtu = Q[qi, Q_PMTU]
    rest = mlen - off
    # MR-XH-021: what the packet alone contradicts is dropped and counted before any transport check --
    # offset + payload above Message Length, Message Length above 2^31, a WRITE's RETH.DMA Length other
    # than its Message Length (MR-XH-020), F or L against offset, payload and Message Length (MR-XH-018)
    if plen > rest or mlen > MSG_MAX or (is_write and dlen != mlen) or \
            ((fl & NETH_FIRST) != 0) != (off == 0) or ((fl & NETH_LAST) != 0) != (off + plen == mlen):
        nx[X_C_BAD_LEN] += 1
        A[P_RX_DROP_LEN] += 1
        return
    ackreq = 1 if bth_ackreq(umem, bo) else 0
    ce = 1 if ce_marked(umem, l3) else 0
    sport = udp_sport(umem, udp_of(umem, l3))
    e0 = rx[NL.R_EPSN]
    d = (psn - e0) & PSN_MASK
    want = pmtu if rest > pmtu else rest
    if off % pmtu != 0 or plen != want:
        # check 4 of MR-OOO-001 (after check 3): the offset on a packet boundary of the QP's path MTU and
        # the payload it implies, or an invalid request (MR-SACK-031) -- for a PSN of the window not yet
        # received; beyond the window it is discarded (MR-SACK-011), a copy of a received PSN dropped
        if d < par[NL.P_W] and not rx_recorded(rx, par, psn):
            nat_reject(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_INV_REQ, psn, WHY_PAYLOAD_LENGTH, ce, 1,
                       tsval, sport, now)
        elif d < NL.PSN_HALF and d >= par[NL.P_W]:
            nx[X_C_OOW] += 1
        else:
            nx[X_C_BAD_LEN] += 1
            A[P_RX_DROP_LEN] += 1
        return
    npk = (rest + pmtu - 1) // pmtu
    if npk < 1:
        npk = 1
    last_psn = (psn + npk - 1) & PSN_MASK
    lastp = (fl & NETH_LAST) != 0
    if nx[X_ERR_SYN] and psn == nx[X_ERR_PSN]:
        nx[X_C_ERR_HELD] += 1                        # MR-SACK-031: never recorded while its error waits
        return
    kq = np.int64(0)
    if recv and d < NL.PSN_HALF:                     # not a duplicate of a completed PSN
        rq_head = Q[qi, Q_RQ_HEAD]
        late_recvs(A, Q, RW, MRT, qi)                # what a metaroced client posted, before an RNR (dp/clientq.py)
        rm = A[b + O_RM:b + O_RM + NL.WMAX * NL.NRM].reshape((NL.WMAX, NL.NRM))
        fresh = rm[rsn & NL.WMASK, NL.M_STATE] == 0  # the first packet of its message to be taken
        kq = rx_rsn_check(rx, rm, A[b + O_LR:b + O_LR + NL.WMAX], par, rsn, msn, last_psn,
                          ld_acq_i64(Q[qi], Q_RQ_TAIL) - rq_head)
        if kq == RSN_INVALID:                        # MR-OOO-026: check 5, an invalid request (MR-SACK-031)
            nx[X_C_RSN_INV] += 1
            if d < par[NL.P_W] and not rx_recorded(rx, par, psn):
                nat_reject(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_INV_REQ, psn, WHY_RSN_INVALID, ce, 1,
                           tsval, sport, now)
            elif d >= par[NL.P_W]:
                nx[X_C_OOW] += 1                     # beyond the window: check 3 discards it (MR-SACK-011)
            else:
                A[P_RX_DROP_STATE] += 1              # a copy of a PSN received before
            return
        if kq == RSN_NOT_READY:                      # MR-OOO-012: not recorded; comes again
            rx_on_not_ready(rx, ce, 1, tsval, sport, now)
            nx[X_C_NOTREADY] += 1
            if off == 0 and d == 0:
                # MR-SACK-035: the RNR NAK-type SACK names the message's first PSN once it is the ePSN (and
                # again for each copy of it while not ready); a later first PSN gets it when retransmitted
                nat_send_sack(A, Q, TM, umem, tables, qi, b, RNR_SYN | (Q[qi, Q_MIN_RNR] & 0x1F), psn)
            return
        xi = b + O_RMX + (rsn & NL.WMASK) * NRMX + 3
        if fresh:
            A[xi] = imm                              # the message's ImmDt, as its first packet taken says
        elif has_imm and A[xi] != imm and d < par[NL.P_W] and not rx_recorded(rx, par, psn):
            nx[X_C_IMM_INV] += 1                     # MR-OOO-011: check 5, invalid request (MR-SACK-031)
            nat_reject(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_INV_REQ, psn, WHY_IMMDT_DIFFERS, ce, 1,
                       tsval, sport, now)
            return
    src = A[P_UMEM_ADDR] + h
    mr = np.int64(0)
    if is_write and d < NL.PSN_HALF and d < par[NL.P_W] and plen > 0:
        # a VA >= 2^63 (negative here) is refused before the offset is added to it (STYLE 14, MR-SEC-004)
        mr = mr_check(MRT, rkey, Q[qi, Q_PD], va + off, plen, ACC_REMOTE_WRITE) if va >= 0 else np.int64(-1)
        if mr < 0 or (Q[qi, Q_ACCESS] & ACC_REMOTE_WRITE) == 0:
            nat_reject(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_REM_ACCESS, psn, WHY_REMOTE_ACCESS, ce, 1,
                       tsval, sport, now)
            return
    rr = np.int64(0)
    if recv and d < NL.PSN_HALF and d < par[NL.P_W]:
        rr = Q[qi, Q_RQ_BASE] + ((Q[qi, Q_RQ_HEAD] + kq) & (Q[qi, Q_RQ_SIZE] - 1))
        if not is_write and off + plen > RW[rr, R_LENGTH]:
            # check 9 of MR-OOO-001: longer than the receive WQE, a remote operational error; the receive
            # WQE completes IBV_WC_LOC_LEN_ERR (nat_nak_error)
            nat_reject(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_REM_OP, psn, WHY_SEND_TOO_LONG, ce, 1,
                       tsval, sport, now)
            return
        if not is_write and plen and ((RW[rr, R_LMR] and not mr_live_a(A, RW[rr, R_LMR]))
                                      or not sg_valid(A, RW[rr, R_SG], RW[rr, R_NSGE])):
            nat_reject(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_REM_OP, psn, WHY_RECV_MR_INVALID, ce, 1,
                       tsval, sport, now)
            return
    res = rx_on_packet(rx, par, psn, ackreq, ce, 1, tsval, sport, now)
    if res & RX_OOW:
        nx[X_C_OOW] += 1
        return
    if res & RX_NEW:
        if d != 0:
            nx[X_C_OOO] += 1                         # placed out of order (MR-OOO-001)
        if plen:
            if is_write:
                place(A, va + off, 0, 0, 0, src, plen)
            else:
                place(A, RW[rr, R_LADDR], RW[rr, R_SG], RW[rr, R_NSGE], off, src, plen)
        nx[X_C_PLACED] += 1
        nx[X_C_RX_BYTES] += plen
        A[P_RX_BYTES] += plen
        if lastp:
            A[b + O_LM + (psn & NL.WMASK)] = psn + 1        # a message ends here (MR-SACK-003's MSN)
            if recv:
                x = b + O_RMX + (rsn & NL.WMASK) * NRMX
                A[x] = mlen
                A[x + 1] = imm
                A[x + 2] = (1 if has_imm else 0) | (2 if bth_se(umem, bo) else 0) | (4 if is_write else 0)
    else:
        nx[X_C_DUP] += 1
        A[P_RX_DUP] += 1
    if rx[NL.R_EPSN] != e0:
        nat_advanced(A, Q, RW, CQT, CE, qi, b, e0, st)
        if nx[X_RS_HELD]:
            nat_rd_execute(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b)     # READs, atomics now due
        if Q[qi, Q_STATE] == ST_ERR or nat_error_due(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b):
            activate(A, Q, qi)
            return                                   # the NAK-type SACK acknowledges what came before
    if res & RX_SACK_NOW:
        nat_send_sack(A, Q, TM, umem, tables, qi, b, AETH_ACK_SYN, -1)
    activate(A, Q, qi)


@njit(**_jit)
def nat_qp(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, qi, now, budget):
    """A native QP's turn in the round: the coalesced SACK (MR-SACK-015/017), the timers and
    the requester.  Returns packets sent | (still busy << 32)."""
    b = slot_base(A, nat_slot(A, qi))
    par, rx, s, nx, sb, pt = rows(A, b)
    sent = 0
    # the round's receive batch is done: packets not yet acknowledged get their SACK now, before ack_n
    # or ack_t (MR-SACK-015 "MAY send it earlier"; waiting for ack_t across a loop that yields the CPU
    # held SACKs for milliseconds, and pacing at cwnd / srtt followed the inflated srtt)
    if nx[X_SACK_OWED] or rx[NL.R_SINCE_SACK] > 0:
        if nat_send_sack(A, Q, TM, umem, tables, qi, b, AETH_ACK_SYN, -1):
            sent += 1
    st = Q[qi, Q_STATE]
    if st != ST_ERR:                                 # the responder's READ responses, atomic results
        if nx[X_RS_HELD]:
            nat_rd_execute(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b)
        if nx[X_JB_HEAD] != nx[X_JB_TAIL] and Q[qi, Q_STATE] != ST_ERR:
            sent += nat_rd_send(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b, now, budget)
        st = Q[qi, Q_STATE]
    if st == ST_RTS or st == ST_SQD:
        sent += nat_timers(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, now)
        if Q[qi, Q_STATE] == ST_RTS or Q[qi, Q_STATE] == ST_SQD:
            sent += nat_rd_timers(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, now)
        if Q[qi, Q_STATE] == ST_RTS or Q[qi, Q_STATE] == ST_SQD:
            sent += nat_requester(A, Q, SW, TM, umem, tables, qi, b, now, budget)
            fail_local(A, Q, SW, CQT, CE, qi)
        if Q[qi, Q_SQD_DRAIN]:
            sqd_check(A, Q, SW, qi)
    if Q[qi, Q_STATE] == ST_ERR:
        flush_queues(A, Q, SW, RW, CQT, CE, qi)
        nx[X_JB_HEAD] = nx[X_JB_TAIL]
        nat_rd_pend(A, b, nx)
    busy = rx[NL.R_SINCE_SACK] > 0 or nx[X_SACK_OWED] != 0 or nx[X_JB_HEAD] != nx[X_JB_TAIL] or \
        (Q[qi, Q_STATE] != ST_ERR and Q[qi, Q_SQ_HEAD] != ld_acq_i64(Q[qi], Q_SQ_TAIL))
    return sent | ((1 if busy else 0) << 32)


def read_rate_bps(ifname: str | None, mbps: float | None = None) -> float:
    """The link rate a port's native READ responses share (MR-CC-021), bits/s: `mbps` when given (the
    tunable read_rate_mbps; 0: not paced), else the interface's speed (/sys/class/net/IF/speed; veth says
    10000), else DEFAULT_READ_RATE_BPS.  Context.set_read_rate changes it for one port."""
    if mbps is not None:
        return float(mbps) * 1e6
    from ..congestion import link_rate_bps
    return link_rate_bps(ifname, default=DEFAULT_READ_RATE_BPS)


class NativeSlots:
    """The native region of a port's arena and its slots (dp.context.Plane owns one)."""

    def __init__(self, A: np.ndarray, off: int, maxq: int) -> None:
        self.A, self.off, self.maxq = A, off, maxq
        self.natq = A[off:off + maxq]
        self.base = off + ((maxq + 7) & ~7)
        ext = self.base + NSLOT * SLOT_WORDS
        A[P_NAT_OFF] = off
        A[P_NAT_EXT] = int(A.ctypes.data) + ext * 8
        self.pw = A[ext + EXT_BYTES // 8:ext + EXT_BYTES // 8 + NPW]      # PW_*: shared by the queues' loops
        self.free = list(range(NSLOT - 1, -1, -1))
        self.par_kw: dict[int, dict] = {}
        self.loader = None

    def bind_kernel(self, loader) -> None:
        """The XDP program's NATIVE_SACK rings (kern/loader.XdpLoader.sacks, MR-SACK-043): native slot i's QP
        gets ring i at RTS (start), and every loop of the port drains the rings of its QPs."""
        A = self.A
        if loader is None or getattr(loader, "sacks", None) is None:
            A[P_SR_ADDR] = A[P_SR_N] = 0             # (tunable xdp_sacks off: SACKs through the socket)
            return
        self.loader = loader
        A[P_SR_ADDR] = int(loader.sacks.ctypes.data)
        A[P_SR_SIZE] = loader.sacks.dtype.itemsize
        A[P_SR_N] = min(NSLOT, len(loader.sacks))

    def set_read_rate(self, bps: float) -> None:
        """The link rate the port's READ responses share (MR-CC-021), bits/s; 0: not paced."""
        if bps < 0:
            raise ValueError(f"READ response rate {bps}: bits/s >= 0 (0: not paced)")
        self.pw[PW_RATE] = int(bps)

    @property
    def read_rate(self) -> int:
        return int(self.pw[PW_RATE])

    def _w(self, sl: int, o: int, n: int) -> np.ndarray:
        b = self.base + sl * SLOT_WORDS + o
        return self.A[b:b + n]

    def rows(self, qi: int):
        sl = int(self.natq[qi]) - 1
        if sl < 0:
            return None
        return (self._w(sl, O_PAR, NL.NPAR), self._w(sl, O_RX, NL.NRX), self._w(sl, O_TX, NL.NTX),
                self._w(sl, O_NX, NNX), self._w(sl, O_PT, NL.KMAX * NL.NPT).reshape(NL.KMAX, NL.NPT),
                self._w(sl, O_SP, NL.KMAX))

    def attach(self, qi: int, rq_psn: int, **params) -> None:
        """QP qi runs the native profile from RTR (MR-NAT-003): a slot, the parameters, rx_init."""
        if int(self.natq[qi]):
            self.detach(qi)
        par_row = NL.params(**params)
        if not self.free:
            raise Unsupported(f"at most {NSLOT} native QPs per port")
        sl = self.free.pop()
        b = self.base + sl * SLOT_WORDS
        self.A[b:b + SLOT_WORDS] = 0
        self._w(sl, O_PAR, NL.NPAR)[:] = par_row
        rx_init(self._w(sl, O_RX, NL.NRX), self._w(sl, O_PAR, NL.NPAR), rq_psn & PSN_MASK)
        self.natq[qi] = sl + 1

    def qp_attrs(self, qi: int, timeout: int | None = None, retry_cnt: int | None = None,
                 rnr_retry: int | None = None) -> None:
        """The QP attributes a native QP takes at RTS (and SQD -> RTS) into its parameters: rto_max from the
        IBTA timeout (MR-LOSS-005, raised to the QP's rto_min), retry_cnt (MR-LOSS-009) and rnr_retry
        (MR-SACK-036, 7: unlimited); None leaves one as it is."""
        r = self.rows(qi)
        if r is None:
            return
        par = r[0]
        if timeout is not None:
            par[NL.P_RTO_MAX] = int(round(NL.rto_max_for_timeout(timeout, int(par[NL.P_RTO_MIN]) / 1e9) * 1e9))
        if retry_cnt is not None:
            par[NL.P_RETRY_CNT] = min(7, retry_cnt)
        if rnr_retry is not None:
            par[NL.P_RNR_RETRY] = min(7, rnr_retry)

    def start(self, qi: int, sq_psn: int, sport: int, now: int, tm: np.ndarray | None = None,
              l3: int = -1) -> None:
        """RTS: the requester's state (04 4.3.5, 05 5.2) and the QP's K entropy values, fixed from now on
        (MR-MP-002): distinct ports in 0xC000-0xFFFF from a keyed pseudo-random function (native/multipath.py
        entropy_values) of the local and remote QPNs and GIDs under a per-QP random secret drawn here.
        The flow label key (MR-MP-016) comes from the same function, ends and secret.  sport, the QP's
        compat-style port, is not used (MR-ENC-017 is compat's rule).  tm, l3: the QP's header template
        (its addresses are the GIDs) and, for IPv6, its IP header's offset: the template starts on entropy
        value 0 (its port, and over IPv6 its label) for the SACKs sent before any request."""
        import secrets
        par, rx, s, nx, pt, sp = self.rows(qi)
        tx_init(s, par, sq_psn & PSN_MASK, now)
        sl = int(self.natq[qi]) - 1
        tx_init(self._w(sl, O_TXR, NL.NTX), par, 0, now)                # the READ window (MR-CC-019)
        k = int(par[NL.P_K])
        q = int(self.A[P_Q_OFF]) + qi * NQ
        o = int(self.A[q + Q_L3_OFF])
        gids = b""
        if tm is not None:                       # source then destination address
            gids = bytes(tm[o + O_IP6_SRC:o + O_IP6_DST + IP6_ADDR_SIZE]) if self.A[q + Q_IPV6] else \
                bytes(tm[o + O_IP4_SRC:o + O_IP4_DST + IP4_ADDR_SIZE])
        ends = entropy_context(int(self.A[q + Q_QPN]), int(self.A[q + Q_DEST_QP]), gids[:len(gids) // 2],
                               gids[len(gids) // 2:])
        secret = secrets.token_bytes(16)                                # per QP, never leaves this call
        sp[:] = entropy_values(secret, ends, len(sp))                   # MR-MP-002: the K values, then the
        # fresh ones MR-MP-011 may take (mp_init keeps them in the rows after K)
        mp_init(pt, par, sp)
        nx[X_FL_KEY] = flow_label_key(secret, ends)                     # MR-MP-016
        if tm is not None:                       # over IPv4 too: a SACK before any request is a native packet
            u = o + (IP6_SIZE if self.A[q + Q_IPV6] else IP4_SIZE)  # of the QP (MR-MP-001, MR-MP-003)
            put_field(tm, u, UDP, "sport", int(sp[0]))
        if tm is not None and l3 >= 0:
            put_field(tm, l3, IPv6, "flow_label", flow_label.py_func(int(nx[X_FL_KEY]), int(sp[0])))
        self._kernel_ring(qi)

    def _kernel_ring(self, qi: int) -> None:
        """From now on the XDP program puts QP qi's NATIVE_SACKs in its slot's ring (MR-SACK-043)."""
        sl = int(self.natq[qi]) - 1
        if self.loader is None or not 0 <= sl < int(self.A[P_SR_N]):
            return
        qpn = int(self.A[int(self.A[P_Q_OFF]) + qi * NQ + Q_QPN])
        self.loader.set_sack_ring(qpn, sl, owner=qi + 1)

    def detach(self, qi: int) -> None:
        sl = int(self.natq[qi]) - 1
        if sl >= 0:
            rp = self._w(sl, O_RP, NRP)
            if rp[RP_PEND]:                                # counted among the pending (called paused)
                rp[RP_PEND] = 0
                self.pw[PW_NPEND] -= 1
            self.natq[qi] = 0
            self.free.append(sl)
            if self.loader is not None and sl < int(self.A[P_SR_N]):
                self.loader.sacks[sl]["owner"] = 0         # its loop stops draining; the next start skips the rest

    def sack_counters(self, qi: int) -> dict:
        """QP qi's NATIVE_SACK ring: SACKs consumed in the kernel (k_sack_pushed), steered to the socket
        because it was full or contended or the loop asleep (k_sack_full, k_sack_busy, k_sack_asleep),
        applied and discarded by the loop."""
        sl = int(self.natq[qi]) - 1
        if self.loader is None or not 0 <= sl < int(self.A[P_SR_N]):
            return {}
        r = self.loader.sacks[sl]
        return {"k_sack_pushed": int(r["pushed"]), "k_sack_full": int(r["full"]), "k_sack_busy": int(r["busy"]),
                "k_sack_asleep": int(r["asleep"]),
                "c_sack_kern": int(r["drained"]), "c_sack_kern_discarded": int(r["discarded"])}

    def counters(self, qi: int) -> dict:
        r = self.rows(qi)
        if r is None:
            return {}
        par, rx, s, nx, pt, sp = r
        out = {n: int(nx[i]) for i, n in enumerate(NX_FIELDS) if n.startswith("c_")}
        out.update({n: int(s[getattr(NL, "S_" + n.upper())]) for n in NL.TX_FIELDS if n.startswith("c_")})
        out.update({"rx_" + n: int(rx[getattr(NL, "R_" + n.upper())]) for n in NL.RX_FIELDS if n.startswith("c_")})
        out.update(srtt_ns=int(s[NL.S_SRTT]), rto_ns=int(s[NL.S_RTO]), cwnd=int(s[NL.S_CWND]) / NL.FP,
                   alpha=int(s[NL.S_ALPHA]) / NL.FP,
                   snd_una=int(s[NL.S_SND_UNA]), snd_nxt=int(s[NL.S_SND_NXT]), epsn=int(rx[NL.R_EPSN]),
                   rd_gap_ns=int(nx[X_RD_GAP]))
        k = int(par[NL.P_K])                                           # the entropy values (MR-MP-010/011)
        out.update(mp_evicted=int(pt[:k, NL.E_C_EVICT].sum()), mp_replaced=int(pt[:k, NL.E_C_REPLACE].sum()))
        rd = self._w(int(self.natq[qi]) - 1, O_TXR, NL.NTX)           # the READ window (MR-CC-019)
        out.update(rd_cwnd=int(rd[NL.S_CWND]) / NL.FP, rd_srtt_ns=int(rd[NL.S_SRTT]),
                   rd_alpha=int(rd[NL.S_ALPHA]) / NL.FP,
                   c_rd_dec_delay=int(rd[NL.S_C_DEC_DELAY]), c_rd_dec_ecn=int(rd[NL.S_C_DEC_ECN]),
                   c_rd_dec_loss=int(rd[NL.S_C_DEC_LOSS]))
        rp = self._w(int(self.natq[qi]) - 1, O_RP, NRP)                # READ response pacing (MR-CC-021)
        out.update(c_rd_pace_wait=int(rp[RP_C_WAIT]), c_rd_paced=int(rp[RP_C_PACED]),
                   c_rd_paced_shared=int(rp[RP_C_SHARED]), rd_pace_bps=int(rp[RP_SHARE]),
                   rd_pace_min_bps=int(rp[RP_SHARE_MIN]), rd_pace_link_bps=int(self.pw[PW_RATE]),
                   rd_pace_pending_qps=int(self.pw[PW_NPEND]))
        out.update(self.sack_counters(qi))
        return out
