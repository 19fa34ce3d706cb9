"""The data plane's state: declared dtypes, carved out of one shared buffer.

Every table is a numpy structured dtype whose fields are all 8-byte integers, so the
compiled loop sees each table as a 2-D int64 array (row = entry, column = field, the
column numbers below) and Python sees named records of the same bytes.  All tables of
a port live in one `Arena`: a single anonymous shared mapping (MAP_SHARED), so a later
daemon can put the same bytes in shared memory and hand them to clients.

Tables (sizes per port):
  P    port scalars: ring addresses, counters, ready/event ring indices, flags
  QP   MAX_QPS rows, row = qpn % MAX_QPS (the kernel's mr_qps slot)
  SWQE send queues: each QP owns a power-of-two ring of rows
  RWQE receive queues, likewise
  CQE  completion queues: each CQ owns a ring of rows
  CQ   MAX_CQS rows: base, size, head (Python), tail (loop)
  MR   MAX_MRS rows: address, length, key, PD, access, valid, ref (checked on every access)
  RDJ  READ responses (and ATOMIC ACKNOWLEDGEs) still to send: MAX_RD jobs per QP, each with the
       coalesced ACK held behind it, if any (MR-RC-025)
  EV   events for Python (errors, state changes): a ring
  RDY  QPs marked by a post (Python produces, the loop consumes)
  ACT  QPs with outstanding work: the only ones the loop looks at
  (P.sr_addr: the XDP program's mmapped NATIVE_SACK rings, kern/layout.SACK_RING_DTYPE, sr_n of
   sr_size bytes; dp/native.py nat_kern_sacks drains them: MR-SACK-043)
  FREE the UMEM frame free stack (chunk addresses; with multi-buffer, P.sg = 1, slot addresses:
       two adjacent chunks, P.frame_mask the slot's mask, P.frame_size the chunk)
"""
from __future__ import annotations

import mmap

import numpy as np

MAX_QPS = 1024            # = the XDP program's MR_MAX_QPS (kern/loader.XdpLoader(max_qps))
MAX_CQS = 256
MAX_MRS = 4096            # a power of two: the key's low index bits select the row (key_slot)
MR_SLOT_MASK = MAX_MRS - 1
MR_BAD_SLOT = MAX_MRS - 1  # an MR row never registered
MR_BAD = MR_BAD_SLOT << 8  # the MR reference of a WQE whose SGE failed its local checks (MR-RC-022): never live
MR_LEN = MR_BAD | 1        # the MR reference of a WQE whose SGEs add up to more than 2^31 bytes (MR-RC-008): never live
MAX_RD = 16               # outstanding READs a responder queues per QP (max_dest_rd_atomic)
N_EV = 1024
N_RDY = 4096              # power of two, > MAX_QPS: a QP is in it at most once (Q_READY)
TX_BATCH = 64
PSN_MASK = 0xFFFFFF
PSN_NONE = 0xFFFFFFFF
ACKREQ_EVERY = 32         # rc/requester.py ACKREQ_EVERY (MR-ACK-013)


def _cols(names: str) -> list[str]:
    return names.split()


# ---- port scalars ------------------------------------------------------------------
P_FIELDS = _cols("""
    magic maxq sq_off rq_off ce_off cq_off mr_off rdj_off ev_off rdy_off act_off free_off free_cap free_top
    q_off nq n_act
    rx_prod rx_cons rx_desc rx_size tx_prod tx_cons tx_flags tx_desc tx_size
    fq_prod fq_cons fq_flags fq_addrs fq_size cq_prod cq_cons cq_addrs cq_size
    fd efd umem_addr frame_size frame_mask ks_addr ks_size
    rdy_head rdy_tail ev_head ev_tail stop sleeping pause paused spin_idle poll_ms
    window budget now txn txq_off pollfd scratch
    rx tx rx_drop_icrc rx_drop_qp rx_drop_state rx_drop_len rx_drop_op rx_dup rx_oos tx_ack tx_nak tx_rnr
    tx_no_frame tx_ring_full kicks retransmits timeouts acks_seen naks_seen rnr_seen rx_rsp_stale
    rounds idle_polls wakeups cqe_out rx_bytes tx_bytes
    last_to_comp last_to_max last_to_kack last_to_kseq last_to_head last_to_next last_to_tail
    infl_left qp_share rx_owed infl_cap
    at_off sg_off sgx_addr sgx_size f_off tx_cnp rx_cnp rx_ce rx_dup_atomic
    sg rx_sg rx_sg_long
    queue rx_wrong_q
    sr_addr sr_size sr_n rx_sack_kern rx_sack_kern_drop
    yield_after yields
    inv_qp inv_op inv_psn inv_epsn inv_kind inv_len
    ev_drop rx_dup_rd_drop rx_rd_defer rdprot_left rx_cnp_coalesced
""")
for _i, _n in enumerate(P_FIELDS):
    globals()["P_" + _n.upper()] = _i
N_P = 192
assert len(P_FIELDS) <= N_P - 32        # the rest: TX scratch lives at txq_off
MAGIC = 0x4D52_4450_0001                # "MRDP" v1

# ---- QP table -------------------------------------------------------------------------
Q_FIELDS = _cols("""
    qpn state pd access dest_qp pmtu send_cq recv_cq sig_all
    sq_base sq_size sq_head sq_next sq_tail rq_base rq_size rq_head rq_tail
    tmpl_len l3_off ipv6 ready active
    snd_psn snd_max comp_psn timeout_ns deadline retry_cnt retry_left rnr_retry rnr_left rnr_until rnr_psn
    rd_out max_rd rr_retry
    k_seq k_ack k_nak_seq k_rnr_seq pub_comp
    epsn msn ack_pend nak_pend nak_psn min_rnr
    r_kind r_addr r_left r_mr r_total r_wqe r_imm
    rd_head rd_tail err flushed sq_psn0 pkey nerr_psn nerr_code fnak_syn fnak_psn fnak_ev fnak_why pub_nakr locerr
    sqd_drain sqd_notify at_head at_tail r_sg r_nsge r_inv k_cnp cnp_last rp_on comm_est
    to_win
    plane n_retx n_naks_tx
    read_run max_dest impl_nak n_to
""")
for _i, _n in enumerate(Q_FIELDS):
    globals()["Q_" + _n.upper()] = _i
NQ = len(Q_FIELDS)

# Q_READ_RUN: 1 + the PSN of the first of the READ REQUESTs executed last, 0 when the last request executed
# was not a READ: the coalesced ACK is then sent at that PSN - 1 (MR-DUP-002 r - 1, dp/loop.py ack_psn)

# Q_IMPL_NAK: 1 + comp_psn when a kernel-consumed ACK implied a NAK for the READ/ATOMIC at comp_psn; the retry
# waits until the loop has drained the RX ring once more (dp/loop.py implied_nak, MR-RETRY-015), 0: none
# Q_MAX_DEST: the QP's max_dest_rd_atomic, 0 to MAX_RD: the READ/ATOMIC entries of resources[] (MR-DUP-007)

# responder message in progress (Q_R_KIND)
RK_NONE, RK_SEND, RK_WRITE = 0, 1, 2

# ---- send WQE -------------------------------------------------------------------------
W_FIELDS = _cols("wr_id opcode flags laddr length raddr rkey imm first_psn npsn sent started done status lmr "
                 "swap sg nsge")
for _i, _n in enumerate(W_FIELDS):
    globals()["W_" + _n.upper()] = _i
NW = len(W_FIELDS)

# ---- receive WQE ----------------------------------------------------------------------
R_FIELDS = _cols("wr_id laddr length lmr sg nsge")
for _i, _n in enumerate(R_FIELDS):
    globals()["R_" + _n.upper()] = _i
NR = len(R_FIELDS)

# ---- completion -----------------------------------------------------------------------
E_FIELDS = _cols("wr_id status opcode byte_len qp_num imm flags")
for _i, _n in enumerate(E_FIELDS):
    globals()["E_" + _n.upper()] = _i
NE = len(E_FIELDS)

C_FIELDS = _cols("base size head tail overflow armed")
for _i, _n in enumerate(C_FIELDS):
    globals()["C_" + _n.upper()] = _i
NC = len(C_FIELDS)

# ref: this registration's MR reference, (generation << 32) | key, the generation a per-context count of
# registrations (1 .. 2^31 - 1, then round again; 0: no MR).  Work that outlives a packet (a WRITE in progress, a queued
# READ response, a posted WQE or SGE) keeps the reference, never the bare row, and dp/loop.py mr_live
# compares it with the row's on every use: a deregistered or re-registered row no longer matches
# (MR-SEC-003, MR-MEM-011)
M_FIELDS = _cols("addr length key pd access valid ref")
for _i, _n in enumerate(M_FIELDS):
    globals()["M_" + _n.upper()] = _i
NM = len(M_FIELDS)

# ack, amsn: a coalesced ACK that leaves right after this job's responses (MR-RC-025): 1 + its PSN (0: none)
# and the MSN it carries (dp/loop.py ack_now); nak, nmsn: likewise a PSN sequence error NAK or RNR NAK,
# 1 + (syndrome << 24 | PSN), after the ACK (dp/loop.py send_nak)
J_FIELDS = _cols("psn addr length mr npk sent ack amsn nak nmsn")
for _i, _n in enumerate(J_FIELDS):
    globals()["J_" + _n.upper()] = _i
NJ = len(J_FIELDS)

EV_FIELDS = _cols("type qp arg arg2")
NEVF = len(EV_FIELDS)

# event types (EV.type) the loop hands to Python
EV_QP_FATAL, EV_CQ_ERR, EV_QP_REQ_ERR, EV_QP_ACCESS_ERR = 1, 2, 3, 4
EV_CQ_NOTIFY, EV_SQ_DRAINED = 5, 6      # an armed CQ got its completion; an SQD QP drained (dp/ops.py)
EV_COMM_EST = 7                         # the first request accepted in RTR (MR-QP-021)

# ---- gather/scatter lists of more than one SGE (dp/ops.py) -----------------------------------
# a WQE with nsge > 1 names nsge rows of the SG table (addr, length, mr) from row sg; one SGE stays
# in the WQE itself (laddr, length, lmr) as before; mr and lmr are MR references (M_REF), not rows
G_FIELDS = _cols("addr length mr")
for _i, _n in enumerate(G_FIELDS):
    globals()["G_" + _n.upper()] = _i
NG = len(G_FIELDS)
SG_ROWS = 1 << 16
assert MAX_MRS & MR_SLOT_MASK == 0 and MAX_MRS <= 1 << 24


def key_slot(key: int) -> int:
    """The MR table row an lkey/rkey or MR reference names: the low 12 bits of its 24-bit index (MR-MEM-008;
    the index's upper bits are random, context.reg_mr).  The one decoder: dp/loop.py key_row is its
    compiled twin."""
    return (int(key) >> 8) & MR_SLOT_MASK


# ---- saved ATOMIC results per QP: (psn, original value) x MAX_RD, a ring (MR-DUP-005) ----------
NAT = 2
# ---- floating-point state per QP (DCQCN reaction point, dp/ops.py), NF words a QP ---------------
F_FIELDS = _cols("rc rt alpha tokens t_tokens alpha_due rate_due t_cnt b_cnt bytes_since cnp_in_period rx_cnp "
                 "rate_cuts rate_min np_last np_tx np_ce rp_last_cut cnp_coalesced")
for _i, _n in enumerate(F_FIELDS):
    globals()["F_" + _n.upper()] = _i
NF = 24
# F row 0 holds the port's DCQCN parameters (rc/dcqcn.py DcqcnParams, same names); QP rows start at 1
D_FIELDS = _cols("enabled cnp_interval_ns cnp_dscp g alpha_init k_ns t_ns b_bytes f r_ai_bps r_hai_bps r_min_bps "
                 "r_line_bps burst_bytes")
for _i, _n in enumerate(D_FIELDS):
    globals()["D_" + _n.upper()] = _i
TM_CNP = 128            # TM columns [128, 256): the QP's CNP template (DSCP cnp_dscp, Not-ECT, BECN)
# MR access bit (above the verbs flags) of an MR a SEND WITH INVALIDATE may invalidate (MR-MEM-042)
ACC_REMOTE_INV = 1 << 16


def dtype_of(fields: list[str]) -> np.dtype:
    return np.dtype([(n, "<i8") for n in fields])


QP_DTYPE = dtype_of(Q_FIELDS)
SWQE_DTYPE = dtype_of(W_FIELDS)
RWQE_DTYPE = dtype_of(R_FIELDS)
CQE_DTYPE = dtype_of(E_FIELDS)
CQ_DTYPE = dtype_of(C_FIELDS)
MR_DTYPE = dtype_of(M_FIELDS)
RDJ_DTYPE = dtype_of(J_FIELDS)
EV_DTYPE = dtype_of(EV_FIELDS)


class Arena:
    """One anonymous shared mapping holding every table of a port, as int64 words.

    `alloc(n)` hands out word ranges (bump allocation; queues are sized at create time and
    their rows come from per-kind pools below, so nothing grows while traffic runs)."""

    def __init__(self, words: int) -> None:
        self.words = words
        self._mm = mmap.mmap(-1, words * 8, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.a = np.frombuffer(self._mm, dtype=np.int64)
        self.top = 0

    def alloc(self, n: int, align: bool = True) -> int:
        off = (self.top + 7) & ~7 if align else self.top    # 64-byte aligned, or right after the last
        if off + n > self.words:
            raise MemoryError(f"arena of {self.words} words is full")
        self.top = off + n
        return off

    def view(self, off: int, rows: int, dtype: np.dtype) -> np.ndarray:
        return self.a[off:off + rows * (dtype.itemsize // 8)].view(dtype)

    def close(self) -> None:
        self.a = None
        try:
            self._mm.close()
        except BufferError:
            pass


class RowPool:
    """First-fit allocator of power-of-two row ranges inside one table region (SQ/RQ/CQE rows)."""

    def __init__(self, base: int, rows: int) -> None:
        self.base, self.rows = base, rows
        self.free: list[tuple[int, int]] = [(0, rows)]

    def alloc(self, n: int) -> int:
        for i, (s, ln) in enumerate(self.free):
            if ln >= n:
                self.free[i] = (s + n, ln - n)
                return s
        raise MemoryError(f"no room for {n} more rows (of {self.rows})")

    def release(self, start: int, n: int) -> None:
        self.free.append((start, n))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for s, ln in self.free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + ln)
            elif ln:
                merged.append((s, ln))
        self.free = merged
