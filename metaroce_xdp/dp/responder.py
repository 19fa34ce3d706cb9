"""The responder: requests in, placement, READ responses and ACKs out.

`responder` checks a request in the order of IBTA Table 3-4 (MR-NAK-014) -- PSN (duplicates re-ACKed, a
gap answered by one sequence-error NAK), opcode sequence, the QP's access flags, a receive WQE (RNR NAK when
none is posted) or the responder resources (`rd_full`: max_dest_rd_atomic, NAK invalid request), lengths
(NAK invalid request), the MR's key, bounds and access (NAK remote access) -- then places SEND and WRITE
payloads in order, consumes RECVs, and queues READs as jobs of the QP's ring (MAX_RD slots; a duplicate's
replay holds none of the max_dest_rd_atomic resources).  A request NAKed after it took a receive WQE
completes that WQE with the error (`fail_recv`, Table 7-6).  `read_responses`
sends the queued READ responses and ATOMIC ACKNOWLEDGEs in PSN order within the round's budget;
duplicate READs are answered again from the MR (`dup_read_saved`).  ACKs are coalesced: `ack_now` at the
end of a burst, at the PSN of the last request not waiting behind a READ response (MR-DUP-002).

* SEND WITH INVALIDATE (MR-MEM-040 to MR-MEM-043): the IETH names an MR of the QP's PD registered remotely
  invalidatable (ACC_REMOTE_INV in the MR table's access word); the receive completion carries WITH_INV
  and the key; afterwards no access through that key succeeds (`inv_ok`, `invalidate`).
* READ before a later write (MR-RC-025): `protect_reads` sends the queued READ responses that would read
  bytes a later WRITE, SEND or ATOMIC is about to write.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from .. import jitcache  # noqa: F401  (cache keyed on every module compiled code depends on)

from .layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from ..wire.hdr import (BTH_SIZE, OPT, OT_IETH, OT_IMMDT, OT_PAY, OT_RETH, bth_ackreq, bth_se, ext_at, ieth_rkey,
                        immdt_imm, put_aeth, put_atomicacketh, reth_dlen, reth_rkey, reth_va)
from ..wire.psn import psn_diff
from .layout import ACC_REMOTE_INV, G_ADDR, G_LENGTH, MAX_RD, NJ, PSN_MASK, RK_NONE, RK_SEND, RK_WRITE
from .reasons import (WHY_ACCESS_OR_DMA_LENGTH, WHY_INVALIDATE_REFUSED, WHY_OPCODE_SEQUENCE, WHY_PAYLOAD_LENGTH,
                      WHY_RECV_MR_INVALID, WHY_REMOTE_ACCESS, WHY_RESPONDER_RESOURCES, WHY_SEND_TOO_LONG)
from .prims import c_memcpy, ld_acq_i64
from .core import (ACC_REMOTE_READ, ACC_REMOTE_WRITE, AETH_ACK_SYN, CQE_SOLICITED, NAK_INV_REQ, NAK_REM_ACCESS,
                   NAK_REM_OP, NAK_SEQ, OP_ATOMIC_ACK, OP_READ_REQ, OP_RSP_FIRST, OP_RSP_LAST, OP_RSP_MIDDLE,
                   OP_RSP_ONLY, OP_SEND_LAST_INV, OP_SEND_ONLY_INV, RNR_SYN, S_LOC_ACCESS, S_LOC_LEN, S_LOC_PROT, S_OK,
                   S_REM_INV_REQ, WCF_IMM, WCF_INV, WC_RECV, WC_RECV_IMM, emit, key_row, mr_check, mr_live, mr_live_a, place,
                   push_cqe, qp_error, send_syndrome, send_syndrome_msn, sg_rows, sg_valid)
from .cc import FRAME_TO_WIRE, rp_on_sent
from .clientq import late_recvs

_jit = dict(cache=True, nogil=True)


@njit(**_jit)
def responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, syn, psn, ev, why):
    """A NAK that ends the connection (invalid request, remote access), then ERR -- held behind the READ
    responses already queued, which go first (MR-RC-025); meanwhile no new request is taken.  The
    coalesced ACK owed so far goes before it.  A remote access error is counted per QP and port
    (rx_rkey_violation: MR-MEM-019, MR-SEC-006)."""
    if syn == NAK_REM_ACCESS:
        Q[qi, Q_N_RKEY] += 1
        A[P_RX_RKEY] += 1
    ack_now(A, Q, TM, umem, tables, ext, qi)
    if Q[qi, Q_RD_HEAD] != Q[qi, Q_RD_TAIL]:
        if Q[qi, Q_FNAK_SYN] == 0:
            Q[qi, Q_FNAK_SYN], Q[qi, Q_FNAK_PSN], Q[qi, Q_FNAK_EV], Q[qi, Q_FNAK_WHY] = syn, psn, ev, why
        return
    send_syndrome(A, Q, TM, umem, tables, ext, qi, syn, psn)
    qp_error(A, Q, SW, CQT, CE, qi, -1, ev, why)


@njit(**_jit)
def rd_full(A, Q, qi):
    """MR-DUP-007 (Table 3-4 row 4): a new READ or ATOMIC exceeds the responder resources when
    max_dest_rd_atomic is 0 or every entry holds a READ/ATOMIC whose responses have not all been sent
    yet (a queued job: its requester cannot have completed it).  The replay of a duplicate (J_DUP) is
    no entry of its own: it answers a request that already holds one, or held one."""
    m = Q[qi, Q_MAX_DEST]
    if m == 0:
        return True
    n = 0
    i = Q[qi, Q_RD_HEAD]
    while i != Q[qi, Q_RD_TAIL]:
        if A[A[P_RDJ_OFF] + (qi * MAX_RD + (i % MAX_RD)) * NJ + J_DUP] == 0:
            n += 1
        i += 1
    return n >= m


@njit(**_jit)
def fail_recv(A, Q, RW, CQT, CE, qi, status, opcode):
    """Table 7-6 (MR-QP-032): the receive WQE in use -- the one a SEND in progress fills, or the one the
    request being NAKed took -- completes with `status` (IBV_WC_REM_INV_REQ_ERR for an invalid request,
    IBV_WC_LOC_ACCESS_ERR for a WRITE WITH IMMEDIATE failing the R_Key check), not flushed."""
    r = Q[qi, Q_RQ_BASE] + (Q[qi, Q_RQ_HEAD] & (Q[qi, Q_RQ_SIZE] - 1))
    push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], status, opcode, 0, 0, 0)
    Q[qi, Q_RQ_HEAD] += 1
    Q[qi, Q_R_KIND] = RK_NONE


@njit(**_jit)
def sequence_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, ext, qi, psn):
    """A request out of the opcode sequence (MR-RC-016): the receive WQE of a SEND in progress completes
    IBV_WC_REM_INV_REQ_ERR (Table 7-6), then NAK invalid request and the QP's error.  A caller that
    records the invalid packet (note_invalid) does so first: it reads the message in progress, which
    fail_recv ends."""
    if Q[qi, Q_R_KIND] == RK_SEND:
        fail_recv(A, Q, RW, CQT, CE, qi, S_REM_INV_REQ, WC_RECV)
    responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                    EV_QP_REQ_ERR, WHY_OPCODE_SEQUENCE)


@njit(**_jit)
def push_read_job(A, Q, MRT, qi, psn, va, rkey, dlen):
    """Queue the READ RESPONSEs for a READ request (new or duplicate); False: access violation."""
    mr = 0
    if dlen > 0:
        mr = mr_check(MRT, rkey, Q[qi, Q_PD], va, dlen, ACC_REMOTE_READ)
        if mr < 0 or (Q[qi, Q_ACCESS] & ACC_REMOTE_READ) == 0:
            return -1
    if Q[qi, Q_RD_TAIL] - Q[qi, Q_RD_HEAD] >= MAX_RD:
        return 0                                    # the ring is full (replays too): dropped, retried
    j = A[P_RDJ_OFF] + (qi * MAX_RD + (Q[qi, Q_RD_TAIL] % MAX_RD)) * NJ
    pmtu = Q[qi, Q_PMTU]
    A[j + J_PSN] = psn
    A[j + J_ADDR] = va
    A[j + J_LENGTH] = dlen
    A[j + J_MR] = mr
    A[j + J_NPK] = max(1, (dlen + pmtu - 1) // pmtu)
    A[j + J_SENT] = 0
    A[j + J_ACK] = 0
    A[j + J_NAK] = 0
    A[j + J_DUP] = 0                                # the caller marks a duplicate's replay
    Q[qi, Q_RD_TAIL] += 1
    return 1


@njit(**_jit)
def abandon_replays(A, Q, qi, psn):
    """MR-DUP-008: a duplicate READ REQUEST at psn restarts its READ there; the responses still queued for
    that READ (its first execution or an earlier replay: a queued READ job whose PSNs hold psn) are not
    sent -- the requester asked again from psn and drops them as stale.  Replaying every duplicate in
    full instead let a go-back-N over a large READ queue up to max_dest_rd_atomic replays of it, and the
    ACKs behind them waited past the requester's local ACK timeout until its retries ran out.  The
    jobs' ACK/NAK attachments still leave in order."""
    i = Q[qi, Q_RD_HEAD]
    while i != Q[qi, Q_RD_TAIL]:
        j = A[P_RDJ_OFF] + (qi * MAX_RD + (i % MAX_RD)) * NJ
        k = psn_diff(psn, A[j + J_PSN])
        if A[j + J_LENGTH] >= 0 and k >= 0 and k < A[j + J_NPK] and A[j + J_SENT] < A[j + J_NPK]:
            A[j + J_SENT] = A[j + J_NPK]
        i += 1


@njit(**_jit)
def dup_read_saved(A, Q, MRT, qi, psn, va, rkey, dlen):
    """MR-DUP-003, MR-DUP-007: a duplicate READ REQUEST is executed again only when it asks for part of
    one of the READs the responder still keeps -- the last max_dest_rd_atomic READ/ATOMIC jobs, which
    stay in the job ring's slots after they were sent, and the replays of duplicates among and after
    them (J_DUP: no entry of resources[] of their own, so they do not push a READ out of it) -- from the
    PSN of that part on: the saved READ's PSN range holds psn, the R_Key names the same MR, and
    [va, va + dlen) lies within what the saved READ has left from psn on.  Anything else is discarded,
    as rxe does: 60 bytes in must not buy a re-execution of any READ ever answered (up to GiBs out)."""
    pmtu = Q[qi, Q_PMTU]
    t = Q[qi, Q_RD_TAIL]
    lo = max(0, t - MAX_RD)                          # the slots not written over yet
    left = Q[qi, Q_MAX_DEST]                         # resources[]: max_dest_rd_atomic entries (MR-DUP-007)
    mr = -1
    while t > lo and left > 0:
        t -= 1
        j = A[P_RDJ_OFF] + (qi * MAX_RD + (t % MAX_RD)) * NJ
        if A[j + J_DUP] == 0:
            left -= 1
        slen = A[j + J_LENGTH]
        if slen < 0:                                 # an ATOMIC's job
            continue
        k = psn_diff(psn, A[j + J_PSN])
        if k < 0 or k >= A[j + J_NPK]:
            continue
        if slen > 0 and dlen > 0:
            if mr == -1:
                mr = mr_check(MRT, rkey, Q[qi, Q_PD], va, dlen, ACC_REMOTE_READ)
            if mr != A[j + J_MR]:
                # the saved READ's own R_Key matches even when its MR has gone since: the re-execution's
                # key check then fails and is NAKed with code 2 (MR-DUP-003, MR-MEM-021, MR-MEM-033)
                ref = A[j + J_MR]
                i = key_row(ref)
                if not (mr < 0 and MRT[i, M_REF] == ref and MRT[i, M_KEY] == rkey):
                    continue
        skip = k * pmtu                              # no overflow: k < J_NPK <= 2^31 / pmtu + 1
        if skip > slen:
            continue
        base = A[j + J_ADDR] + skip
        if dlen == 0 or (va >= base and va - base <= (slen - skip) - dlen):
            return True
    return False


@njit(**_jit)
def ack_psn(Q, qi):
    """The PSN of the coalesced ACK (MR-ACK-001): epsn - 1; but while the last requests executed were
    RDMA READs -- only duplicates can have asked for an ACK then -- r - 1, r the PSN of the first of
    them (MR-DUP-002, as rxe does): a requester whose READ responses were
    lost must not take the re-ACK for them."""
    rr = Q[qi, Q_READ_RUN]
    e = rr - 1 if rr else Q[qi, Q_EPSN]
    return (e - 1) & PSN_MASK


@njit(**_jit)
def last_job_before(A, Q, qi, psn, inclusive):
    """The newest queued READ RESPONSE / ATOMIC ACKNOWLEDGE job of QP qi whose PSN is before psn (at or
    before it when inclusive): an ACK or NAK for psn is held behind it (MR-RC-025); -1 when none is."""
    h = Q[qi, Q_RD_HEAD]
    t = Q[qi, Q_RD_TAIL]
    while t != h:
        t -= 1
        j = A[P_RDJ_OFF] + (qi * MAX_RD + (t % MAX_RD)) * NJ
        d = psn_diff(A[j + J_PSN], psn)
        if d < 0 or (inclusive and d == 0):
            return j
    return -1


@njit(**_jit)
def ack_now(A, Q, TM, umem, tables, ext, qi):
    """The coalesced ACK owed (Q_ACK_PEND) is decided now, with the PSN (ack_psn) and MSN of now: sent at
    once -- unless READ responses or ATOMIC ACKNOWLEDGEs of
    PSNs up to it are still queued: then it is attached to the last of those jobs and leaves right
    after its responses (read_responses), so that responses leave in PSN order (MR-RC-025); an ACK
    attached there before is replaced (coalesced, MR-ACK-003: no READ between them).  With no job
    queued this costs one test.  False when it had to be sent and no TX frame was free (the flag stays)."""
    if Q[qi, Q_ACK_PEND] == 0:
        return True
    psn = ack_psn(Q, qi)
    j = last_job_before(A, Q, qi, psn, 1)
    if j >= 0:
        A[j + J_ACK] = psn + 1
        A[j + J_AMSN] = Q[qi, Q_MSN]
        if A[j + J_NAK] and psn_diff(psn, (A[j + J_NAK] - 1) & PSN_MASK) >= 0:
            A[j + J_NAK] = 0                           # requests at the NAK's PSN were executed since
        Q[qi, Q_ACK_PEND] = 0
        return True
    if send_syndrome(A, Q, TM, umem, tables, ext, qi, AETH_ACK_SYN, psn):
        Q[qi, Q_ACK_PEND] = 0
        return True
    return False


@njit(**_jit)
def send_nak(A, Q, TM, umem, tables, ext, qi, syn, psn):
    """A PSN sequence error NAK or an RNR NAK with PSN psn (ePSN), after the coalesced ACK owed: sent at
    once, or -- when READ responses or ATOMIC ACKNOWLEDGEs of earlier PSNs
    are still queued -- attached to the last of those jobs and sent after its responses and its ACK
    (MR-RC-025).  A NAK attached there before stays unless this one names a later PSN (an RNR NAK and
    the sequence error NAK of the packets after it name the same ePSN: the requester goes back to it
    either way)."""
    ack_now(A, Q, TM, umem, tables, ext, qi)
    j = last_job_before(A, Q, qi, psn, 0)
    if j >= 0:
        if A[j + J_NAK] == 0 or psn_diff(psn, (A[j + J_NAK] - 1) & PSN_MASK) > 0:
            A[j + J_NAK] = 1 + (((syn & 0xFF) << 24) | (psn & PSN_MASK))
            A[j + J_NMSN] = Q[qi, Q_MSN]
        return True
    return send_syndrome(A, Q, TM, umem, tables, ext, qi, syn, psn)


@njit(**_jit)
def note_invalid(A, Q, qi, op, psn, plen):
    """What the last invalid request NAK (opcode out of sequence, wrong payload length) was about:
    the QP (+1), the packet's opcode, PSN and payload length, the expected PSN and the message in
    progress (RK_*).  The QP's error reason names them (dp/context.py), for the implementation
    at the other end to be told what it sent."""
    A[P_INV_QP] = qi + 1
    A[P_INV_OP] = op
    A[P_INV_PSN] = psn
    A[P_INV_EPSN] = Q[qi, Q_EPSN]
    A[P_INV_KIND] = Q[qi, Q_R_KIND]
    A[P_INV_LEN] = plen


@njit(**_jit)
def responder(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, qi, op, psn, b, end, pad):
    """One request packet (SEND, WRITE, READ) of QP qi; b = BTH offset, end = ICRC offset."""
    e = Q[qi, Q_EPSN]
    d = psn_diff(psn, e)
    hdr = b + BTH_SIZE
    pmtu = Q[qi, Q_PMTU]
    ackreq = bth_ackreq(umem, b) != 0
    if d < 0:                                        # duplicate (MR-DUP-002): ACK again; READ re-executed
        A[P_RX_DUP] += 1
        Q[qi, Q_N_DUP_REQ] += 1                      # rx_dup_req (MR-DUP-010)
        if op == OP_READ_REQ:
            ack_now(A, Q, TM, umem, tables, ext, qi)       # the ACK owed before this READ's responses
            h = ext_at(b, op, OT_RETH)
            va = reth_va(umem, h)
            dlen = reth_dlen(umem, h)
            if not dup_read_saved(A, Q, MRT, qi, psn, va, reth_rkey(umem, h), dlen):
                A[P_RX_DUP_RD_DROP] += 1                 # MR-DUP-003: not one of resources[]: discarded
                return
            abandon_replays(A, Q, qi, psn)
            k = push_read_job(A, Q, MRT, qi, psn, va, reth_rkey(umem, h), dlen)
            if k < 0:
                responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_ACCESS, psn,
                                EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
            elif k > 0:                              # a replay: no responder resource of its own (rd_full)
                A[A[P_RDJ_OFF] + (qi * MAX_RD + ((Q[qi, Q_RD_TAIL] - 1) % MAX_RD)) * NJ + J_DUP] = 1
        else:
            Q[qi, Q_ACK_PEND] = 1
        return
    if d > 0:                                        # out of sequence: one NAK per gap (MR-NAK-003)
        A[P_RX_OOS] += 1
        Q[qi, Q_N_OOS] += 1                          # rx_drop_out_of_seq, each one (MR-SEC-031)
        if Q[qi, Q_NAK_PEND] == 0:
            Q[qi, Q_NAK_PEND] = 1
            send_nak(A, Q, TM, umem, tables, ext, qi, NAK_SEQ, e)      # behind earlier READs (MR-RC-025)
        return
    # the checks of Table 3-4 in its order (MR-NAK-014): opcode sequence (2), QP access flags (3), receive
    # WQE or responder resources (4), lengths (5), R_Key (6), receive WQE scatter list (8), IETH (9)
    kind = Q[qi, Q_R_KIND]
    if op == OP_READ_REQ:
        if kind != RK_NONE:
            note_invalid(A, Q, qi, op, psn, end - pad - hdr)
            sequence_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, ext, qi, psn)
            return
        h = ext_at(b, op, OT_RETH)
        dlen = reth_dlen(umem, h)
        if (Q[qi, Q_ACCESS] & ACC_REMOTE_READ) == 0:
            # a READ the QP does not allow (MR-RC-017): code 1
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                            EV_QP_REQ_ERR, WHY_ACCESS_OR_DMA_LENGTH)
            return
        if rd_full(A, Q, qi):
            # beyond the responder resources, or max_dest_rd_atomic 0 (MR-DUP-007, MR-NAK-006 (f)): code 1
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                            EV_QP_REQ_ERR, WHY_RESPONDER_RESOURCES)
            return
        if dlen > (1 << 31):
            # a DMA Length above 2^31 (MR-XH-004): code 1
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                            EV_QP_REQ_ERR, WHY_ACCESS_OR_DMA_LENGTH)
            return
        # the ACK owed for earlier requests is decided before this READ: its PSN is before the READ's and
        # it leaves before the READ's responses (MR-RC-025, MR-ACK-001)
        ack_now(A, Q, TM, umem, tables, ext, qi)
        k = push_read_job(A, Q, MRT, qi, psn, reth_va(umem, h), reth_rkey(umem, h), dlen)
        if k < 0:
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_ACCESS, psn,
                            EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
            return
        if k == 0:
            return
        Q[qi, Q_NAK_PEND] = 0
        Q[qi, Q_EPSN] = (psn + max(1, (dlen + pmtu - 1) // pmtu)) & PSN_MASK
        Q[qi, Q_MSN] = (Q[qi, Q_MSN] + 1) & PSN_MASK
        if Q[qi, Q_READ_RUN] == 0:
            Q[qi, Q_READ_RUN] = psn + 1                # the first of a run of READs (MR-DUP-002)
        return
    inv = op == OP_SEND_LAST_INV or op == OP_SEND_ONLY_INV     # SEND WITH INVALIDATE
    is_write = op >= 6 and not inv
    sub = op - 6 if is_write else ((2 if op == OP_SEND_LAST_INV else 4) if inv else op)
    first = sub == 0 or sub == 4 or sub == 5
    lastp = sub >= 2
    has_imm = sub == 3 or sub == 5
    want = RK_NONE if first else (RK_WRITE if is_write else RK_SEND)
    if kind != want:
        note_invalid(A, Q, qi, op, psn, end - pad - hdr)
        sequence_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, ext, qi, psn)
        return
    if is_write and first and (Q[qi, Q_ACCESS] & ACC_REMOTE_WRITE) == 0:
        # a WRITE the QP does not allow (MR-RC-017): code 1, before the receive WQE check (row 3 before 4)
        responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                        EV_QP_REQ_ERR, WHY_ACCESS_OR_DMA_LENGTH)
        return
    # row 4: a packet that needs a receive WQE finds one, or gets an RNR NAK (MR-RNR-001) -- before its
    # lengths are looked at; from here on that WQE is in use (a SEND in progress has one too)
    if has_imm or (not is_write and first):
        # no receive WQE: RNR NAK (MR-RNR-001) -- unless a metaroced client posted one the loop had not yet
        # taken from its ring (dp/clientq.py: its post_recv had returned)
        if Q[qi, Q_RQ_HEAD] == ld_acq_i64(Q[qi], Q_RQ_TAIL) and late_recvs(A, Q, RW, MRT, qi) == 0:
            send_nak(A, Q, TM, umem, tables, ext, qi, RNR_SYN | (Q[qi, Q_MIN_RNR] & 0x1F), psn)
            return
    in_use = has_imm or not is_write
    wc_op = WC_RECV_IMM if is_write else WC_RECV
    pay = b + OPT[op, OT_PAY]
    va = np.int64(0)
    rkey = np.int64(0)
    dlen = np.int64(0)
    if is_write and first:
        h = ext_at(b, op, OT_RETH)
        va = reth_va(umem, h)
        rkey = reth_rkey(umem, h)
        dlen = reth_dlen(umem, h)
    imm = np.int64(0)
    if has_imm:
        imm = immdt_imm(umem, ext_at(b, op, OT_IMMDT))
    elif inv:
        imm = ieth_rkey(umem, ext_at(b, op, OT_IETH))
    plen = end - pad - pay
    if plen < 0 or (not lastp and plen != pmtu) or plen > pmtu or (lastp and not first and plen < 1):
        if in_use:
            fail_recv(A, Q, RW, CQT, CE, qi, S_REM_INV_REQ, wc_op)
        note_invalid(A, Q, qi, op, psn, plen)
        responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                        EV_QP_REQ_ERR, WHY_PAYLOAD_LENGTH)
        return
    src = A[P_UMEM_ADDR] + pay
    if not is_write:
        r = Q[qi, Q_RQ_BASE] + (Q[qi, Q_RQ_HEAD] & (Q[qi, Q_RQ_SIZE] - 1))
        if first and not protect_reads_recv(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, qi, r):
            return                                   # earlier READ responses first (MR-RC-025): retransmitted
        if first:
            Q[qi, Q_R_TOTAL] = 0
            Q[qi, Q_R_KIND] = RK_SEND
        if (RW[r, R_LMR] and not mr_live_a(A, RW[r, R_LMR])) or not sg_valid(A, RW[r, R_SG], RW[r, R_NSGE]):
            # the receive buffer's MR was deregistered (or re-registered: MR-SEC-003): the RECV fails,
            # nothing is placed
            push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], S_LOC_PROT, WC_RECV, 0, 0, 0)
            Q[qi, Q_RQ_HEAD] += 1
            Q[qi, Q_R_KIND] = RK_NONE
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_OP, psn,
                            EV_QP_FATAL, WHY_RECV_MR_INVALID)
            return
        if Q[qi, Q_R_TOTAL] + plen > RW[r, R_LENGTH]:
            # the message is longer than the receive buffer: the RECV fails, the requester gets
            # an invalid request NAK (MR-RC-017)
            push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], S_LOC_LEN, WC_RECV, 0, 0, 0)
            Q[qi, Q_RQ_HEAD] += 1
            Q[qi, Q_R_KIND] = RK_NONE
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                            EV_QP_REQ_ERR, WHY_SEND_TOO_LONG)
            return
        if inv and inv_ok(MRT, imm, Q[qi, Q_PD]) < 0:
            # the IETH names no valid, remotely invalidatable MR of the QP's PD (MR-MEM-041, MR-NAK-006 (h))
            push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], S_REM_INV_REQ, WC_RECV, 0, 0, 0)
            Q[qi, Q_RQ_HEAD] += 1
            Q[qi, Q_R_KIND] = RK_NONE
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                            EV_QP_REQ_ERR, WHY_INVALIDATE_REFUSED)
            return
        if plen:
            place(A, RW[r, R_LADDR], RW[r, R_SG], RW[r, R_NSGE], Q[qi, Q_R_TOTAL], src, plen)
        Q[qi, Q_R_TOTAL] += plen
        if lastp:
            flags = (WCF_IMM if has_imm else 0) | (CQE_SOLICITED if bth_se(umem, b) else 0)
            if inv:
                invalidate(MRT, imm, Q[qi, Q_PD])    # MR-MEM-040
                flags |= WCF_INV
            Q[qi, Q_R_KIND] = RK_NONE
            Q[qi, Q_RQ_HEAD] += 1
            Q[qi, Q_MSN] = (Q[qi, Q_MSN] + 1) & PSN_MASK
            push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], S_OK, WC_RECV, Q[qi, Q_R_TOTAL],
                     imm, flags)
    else:
        if first:
            if dlen > (1 << 31):
                # a DMA Length above 2^31 (MR-XH-004): code 1
                if in_use:
                    fail_recv(A, Q, RW, CQT, CE, qi, S_REM_INV_REQ, wc_op)
                responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                                EV_QP_REQ_ERR, WHY_ACCESS_OR_DMA_LENGTH)
                return
            mr = 0
            if dlen > 0:
                mr = mr_check(MRT, rkey, Q[qi, Q_PD], va, dlen, ACC_REMOTE_WRITE)
                if mr < 0:
                    if in_use:                       # Table 7-6: IBV_WC_LOC_ACCESS_ERR, its WQE taken
                        fail_recv(A, Q, RW, CQT, CE, qi, S_LOC_ACCESS, wc_op)
                    responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_ACCESS, psn,
                                    EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
                    return
                if not protect_reads(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, va, dlen):
                    return                           # earlier READ responses first (MR-RC-025): retransmitted
            Q[qi, Q_R_ADDR] = va
            Q[qi, Q_R_LEFT] = dlen
            Q[qi, Q_R_MR] = mr
            Q[qi, Q_R_TOTAL] = dlen
            Q[qi, Q_R_KIND] = RK_WRITE
        elif Q[qi, Q_R_MR] and not mr_live(MRT, Q[qi, Q_R_MR]):
            # its MR deregistered meanwhile, or its row registered again (MR-MEM-033, MR-SEC-003)
            if in_use:
                fail_recv(A, Q, RW, CQT, CE, qi, S_LOC_ACCESS, wc_op)
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_ACCESS, psn,
                            EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
            return
        if plen > Q[qi, Q_R_LEFT] or (lastp and plen != Q[qi, Q_R_LEFT]):
            if in_use:
                fail_recv(A, Q, RW, CQT, CE, qi, S_REM_INV_REQ, wc_op)
            note_invalid(A, Q, qi, op, psn, plen)
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                            EV_QP_REQ_ERR, WHY_PAYLOAD_LENGTH)
            return
        if plen:
            c_memcpy(Q[qi, Q_R_ADDR], src, plen)
        Q[qi, Q_R_ADDR] += plen
        Q[qi, Q_R_LEFT] -= plen
        if lastp:
            Q[qi, Q_R_KIND] = RK_NONE
            Q[qi, Q_MSN] = (Q[qi, Q_MSN] + 1) & PSN_MASK
            if has_imm:
                r = Q[qi, Q_RQ_BASE] + (Q[qi, Q_RQ_HEAD] & (Q[qi, Q_RQ_SIZE] - 1))
                Q[qi, Q_RQ_HEAD] += 1
                push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], S_OK, WC_RECV_IMM, Q[qi, Q_R_TOTAL],
                         imm, WCF_IMM | (CQE_SOLICITED if bth_se(umem, b) else 0))
    A[P_RX_BYTES] += plen
    Q[qi, Q_NAK_PEND] = 0
    Q[qi, Q_EPSN] = (psn + 1) & PSN_MASK
    Q[qi, Q_READ_RUN] = 0
    if ackreq:
        Q[qi, Q_ACK_PEND] = 1


@njit(**_jit)
def read_responses(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, budget):
    """Send READ RESPONSE packets of the oldest queued READ jobs (AETH on FIRST, LAST, ONLY), and after
    a job's last one the coalesced ACK held behind it (ack_now, MR-RC-025)."""
    n = 0
    pmtu = Q[qi, Q_PMTU]
    while n < budget and Q[qi, Q_RD_HEAD] != Q[qi, Q_RD_TAIL]:
        j = A[P_RDJ_OFF] + (qi * MAX_RD + (Q[qi, Q_RD_HEAD] % MAX_RD)) * NJ
        npk = A[j + J_NPK]
        if A[j + J_LENGTH] < 0:                      # an ATOMIC ACKNOWLEDGE, in PSN order (dp/atomics.py)
            if A[j + J_SENT] == 0:
                if not atomic_ack_job(A, Q, TM, umem, tables, ext, qi, j):
                    return n
                A[j + J_SENT] = 1
                n += 1
        while A[j + J_SENT] < npk and n < budget:
            k = A[j + J_SENT]
            if A[j + J_MR] and not mr_live(MRT, A[j + J_MR]):      # MR-MEM-033, MR-SEC-003: NAK the READ's PSN
                Q[qi, Q_RD_HEAD] = Q[qi, Q_RD_TAIL]
                responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_ACCESS,
                                A[j + J_PSN], EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
                return n
            if npk == 1:
                op = OP_RSP_ONLY
            elif k == 0:
                op = OP_RSP_FIRST
            elif k == npk - 1:
                op = OP_RSP_LAST
            else:
                op = OP_RSP_MIDDLE
            ext_len = 0
            if op != OP_RSP_MIDDLE:
                ext_len = put_aeth(ext, 0, AETH_ACK_SYN, Q[qi, Q_MSN])
            off = k * pmtu
            plen = min(pmtu, A[j + J_LENGTH] - off)
            if plen < 0:
                plen = 0
            if not emit(A, Q, TM, umem, tables, qi, op, 0, 0, (A[j + J_PSN] + k) & PSN_MASK, ext, ext_len,
                        A[j + J_ADDR] + off, plen):
                return n
            A[j + J_SENT] = k + 1
            n += 1
        if A[j + J_SENT] >= npk:
            if A[j + J_ACK]:
                if not send_syndrome_msn(A, Q, TM, umem, tables, ext, qi, AETH_ACK_SYN, A[j + J_ACK] - 1,
                                         A[j + J_AMSN]):
                    return n
                A[j + J_ACK] = 0
            if A[j + J_NAK]:
                k = A[j + J_NAK] - 1
                if not send_syndrome_msn(A, Q, TM, umem, tables, ext, qi, k >> 24, k & PSN_MASK, A[j + J_NMSN]):
                    return n
                A[j + J_NAK] = 0
            Q[qi, Q_RD_HEAD] += 1
    return n


@njit(**_jit)
def atomic_ack_job(A, Q, TM, umem, tables, ext, qi, j):
    """Send the ATOMIC ACKNOWLEDGE of job j: the request's PSN, an ACK AETH with the current MSN, the
    original value (MR-ATOM-006, MR-DUP-005).  False when no TX frame was free (sent next round)."""
    ext_len = put_atomicacketh(ext, put_aeth(ext, 0, AETH_ACK_SYN, Q[qi, Q_MSN]), A[j + J_ADDR])
    return emit(A, Q, TM, umem, tables, qi, OP_ATOMIC_ACK, 0, 0, A[j + J_PSN] & PSN_MASK, ext, ext_len, 0, 0)


@njit(**_jit)
def inv_ok(MRT, key, pd):
    """MR-MEM-041: the MR an IETH key may invalidate -- valid, of the QP's PD, registered remotely
    invalidatable (MR-MEM-042) -- or -1."""
    idx = key_row(key)
    if idx <= 0 or idx >= MRT.shape[0]:
        return -1
    if MRT[idx, M_VALID] == 0 or MRT[idx, M_KEY] != key or MRT[idx, M_PD] != pd:
        return -1
    if (MRT[idx, M_ACCESS] & ACC_REMOTE_INV) == 0:
        return -1
    return idx


@njit(**_jit)
def invalidate(MRT, key, pd):
    """MR-MEM-040: from now on no access through the key succeeds; the MR stays registered."""
    idx = inv_ok(MRT, key, pd)
    if idx > 0:
        MRT[idx, M_VALID] = 0


@njit(**_jit)
def reads_overlap(A, Q, qi, addr, n):
    """True when a queued READ response stream still has to read bytes of [addr, addr + n)."""
    pmtu = Q[qi, Q_PMTU]
    t = Q[qi, Q_RD_HEAD]
    while t != Q[qi, Q_RD_TAIL]:
        j = A[P_RDJ_OFF] + (qi * MAX_RD + (t % MAX_RD)) * NJ
        if A[j + J_LENGTH] > 0 and A[j + J_MR] > 0:
            lo = A[j + J_ADDR] + A[j + J_SENT] * pmtu
            hi = A[j + J_ADDR] + A[j + J_LENGTH]
            if lo < addr + n and addr < hi:
                return True
        t += 1
    return False


@njit(**_jit)
def protect_reads(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, addr, n):
    """MR-RC-025, MR-RC-014: a request is executed only after every earlier one, READ responses included.
    The responses are built as they leave, so before a later request writes [addr, addr + n) -- WRITE,
    SEND placement, ATOMIC -- the queued READ responses that would read any of it leave now (the Python
    engine copies such a READ aside).  Only as many as the round has left (P_RDPROT_LEFT, the port's
    budget, shared by the QPs of the round), paid to the QP's pacer: a peer that queues
    max_dest_rd_atomic large READs and then an overlapping request would otherwise hold the port's one
    loop -- every tenant's QPs, no RX -- for the seconds those responses take, past DCQCN's rate.
    False when they could not all leave: the caller drops the request, counted here (P_RX_RD_DEFER), and
    the requester retransmits it (the PSN sequence error NAK of its next packet, or its timer, go-back-N)
    while the rest of the responses leave at their paced rate in the rounds after.  Not an RNR NAK:
    that is for a request that needs a receive WQE (MR-RNR-001), and a WRITE never does; a request
    dropped for want of responder resources is the loss go-back-N exists for (MR-NAK-003)."""
    if Q[qi, Q_RD_HEAD] == Q[qi, Q_RD_TAIL] or n <= 0 or not reads_overlap(A, Q, qi, addr, n):
        return True
    left = A[P_RDPROT_LEFT]
    if left > 0:
        tb0 = A[P_TX_BYTES]
        k = read_responses(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, left)
        A[P_RDPROT_LEFT] = left - k
        rp_on_sent(A, qi, A[P_TX_BYTES] - tb0 + k * FRAME_TO_WIRE)
    if reads_overlap(A, Q, qi, addr, n):
        A[P_RX_RD_DEFER] += 1
        return False
    return True


@njit(**_jit)
def protect_reads_recv(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, qi, r):
    """protect_reads for every piece of receive WQE r (a SEND is placed there)."""
    if Q[qi, Q_RD_HEAD] == Q[qi, Q_RD_TAIL]:
        return True
    if RW[r, R_NSGE] <= 1:
        return protect_reads(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, RW[r, R_LADDR], RW[r, R_LENGTH])
    G = sg_rows(A)
    for i in range(RW[r, R_NSGE]):
        g = RW[r, R_SG] + i
        if not protect_reads(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, G[g, G_ADDR], G[g, G_LENGTH]):
            return False
    return True
