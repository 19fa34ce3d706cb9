"""State of the native profile's transport logic as int64 rows (the style of dp/layout.py).

Every table is a 2-D int64 array (row = entry, column = field); the column numbers are
module constants generated from the field lists below, so compiled code indexes them as
compile-time constants and Python can name them.  The data plane is meant to embed these
rows in its QP table later (docs/native.md); until then each function takes the rows of
one QP:

  RX   responder row, one per QP: ePSN, highest, coalescing, SACK trigger, counters,
       then WMAX/64 words of the received-PSN bitmap (ring indexed by psn & (WMAX-1))
  RM   responder recv-consuming messages, WMAX rows per QP (ring by RSN): MR-OOO-006/014
  TX   requester row, one per QP: snd_una/snd_nxt, RTT/RTO, RACK, timers, congestion
       control (05-congestion.md 5.2), RNR wait, multipath round, counters
  SB   requester scoreboard, WMAX rows per QP (ring by psn & (WMAX-1)): 04 section 4.3.4
  PT   multipath entropy values, KMAX rows per QP: 04 section 4.5.2
  PAR  parameters of one QP (04 section 4.7, 05 section 5.7.1), one row

Units: times in ns (the data plane's clock, CLOCK_MONOTONIC), wire timestamps in us
modulo 2^32 (NETH.tsval, MR-NAT-014); real-valued quantities (cwnd, alpha, path
weights, gains) in fixed point with FP = 2^16 = 1.0.  NONE (-1) is "no value yet"
for times and durations; PSN_NONE for PSNs.
"""
from __future__ import annotations

import numpy as np

WMAX = 1024               # largest SACK window (04 section 4.3.2): ring size of RX bitmap, RM, SB
WMASK = WMAX - 1
KMAX = 256                # entropy values per QP (K is 1-255, MR-MP-001)
PSN_MASK = 0xFFFFFF
PSN_HALF = 0x800000
PSN_NONE = 0xFFFFFFFF
NONE = -1
FP = 1 << 16              # fixed point 1.0
SACK_MAX_WORDS = 32       # MR-SACK-005


def _cols(prefix: str, names: str) -> list[str]:
    out = names.split()
    for i, n in enumerate(out):
        globals()[prefix + n.upper()] = i
    return out


# ---- responder row ------------------------------------------------------------------
RX_FIELDS = _cols("R_", """
    epsn highest nrec since_sack first_ts trig_tsval trig_n trig_sport trig_ce ce_count credit edge last_rx_ts
    rsn_next c_new c_dup c_oow c_sacks c_imm c_rsn_inv c_notready ce_total
""")
R_BM = len(RX_FIELDS)                    # first bitmap word
NRX = R_BM + WMAX // 64

# ---- responder recv-consuming message ring ----------------------------------------------
RM_FIELDS = _cols("M_", "state rsn last_psn msn")
NRM = len(RM_FIELDS)

# ---- requester row ----------------------------------------------------------------------
TX_FIELDS = _cols("S_", """
    isn snd_una snd_nxt srtt rttvar rto min_rtt min_rtt_ts last_rtt
    rack_xmit_ts rack_rtt reo_mult recov_clean retry_count consec_rto probe_out
    rto_at pto_at reo_at last_sack_ts last_tx_ts
    cwnd alpha t_last_dec cwnd_before_cut epoch_pkts epoch_ce epoch_end right_edge best_cum next_send
    in_flight n_lost last_ce_ts
    rnr_until rnr_psn rnr_count mp_round_end failed
    c_sack c_sack_inv c_sack_stale c_retx_sack c_retx_rto c_retx_tlp c_retx_rnr c_spurious
    c_dec_delay c_dec_ecn c_dec_loss c_dec_rto c_loss_nocut c_blk_cwnd c_blk_w c_blk_credit c_blk_pace
    c_rnr c_rnr_wait c_rnr_inv c_tx c_lost
    ce_seen c_rtt_bad
""")
NTX = len(TX_FIELDS)

# ---- scoreboard record (one per outstanding PSN) ------------------------------------------
SB_FIELDS = _cols("B_", "psn flags xmit_ts last_tsval tx_count entropy")
NSB = len(SB_FIELDS)
BF_OUT, BF_SACKED, BF_LOST, BF_RNR = 1, 2, 4, 8     # outstanding record, sacked, lost, rnr_held

# ---- entropy value (path) -----------------------------------------------------------------
PT_FIELDS = _cols("E_", """
    sport state weight current srtt ce_ewma loss_n loss_start evictions evict_until penalized_since
    last_probe dirty since c_tx c_loss c_evict c_replace
""")
NPT = len(PT_FIELDS)
ST_ACTIVE, ST_PENALIZED, ST_EVICTED, ST_PROBING = 0, 1, 2, 3
PICK_PROBE = 1 << 16          # mp_pick: index | PICK_PROBE when the packet is a probe (AckReq)

# ---- parameters ---------------------------------------------------------------------------
# name, default in human units, scale to the stored integer
_US, _MS, _S = 1000, 1_000_000, 1_000_000_000
PARAMS = [
    # 04 section 4.7
    ("w", 256, 1), ("k", 16, 1), ("ack_n", 8, 1), ("ack_t", 5, _US), ("dup_thresh", 3, 1),
    ("reo_floor", 10, _US), ("rto_initial", 4, _MS), ("rto_min", 500, _US), ("rto_max", 1, _S),
    ("pto_min", 50, _US), ("retry_cnt", 7, 1), ("rnr_retry", 7, 1), ("timer_g", 1, _US),
    ("t_peer", 5, _US),
    ("mp_ce_penalty", 0.5, FP), ("mp_rtt_factor", 2.0, FP), ("mp_min_weight", 1 / 16, FP),
    ("mp_initial_weight", 0.25, FP), ("mp_recover", 1 / 8, FP), ("mp_evict_losses", 2, 1),
    ("mp_evict_window", 1, _MS), ("mp_evict_time", 1, _MS), ("mp_evict_max", 64, _MS),
    # local choice (MR-MP-011, MAY), 0/1: an evicted value is replaced by a fresh one instead of probed
    ("mp_replace", 0, 1),
    # 05 section 5.7.1
    ("init_cwnd", 16, FP), ("min_cwnd", 0.01, FP), ("delay_floor", 1.0, FP), ("ai", 1.0, FP), ("beta", 0.8, FP), ("max_mdf", 0.5, FP),
    ("q_target", 25, _US), ("target_min", 15, _US), ("target_max", 500, _US), ("min_rtt_win", 10, _S),
    ("g_ecn", 1 / 16, FP), ("alpha_init", 1.0, FP), ("pacing_gain", 1.25, FP), ("max_burst", 8, 1),
    ("rto_cwnd_reset", 2, 1), ("init_credit", 16, 1), ("rx_budget", 16, 1), ("active_window", 100, _US),
    ("credit_interval", 20, _US),
    # agreed capabilities (06-connection.md), 0/1
    ("credits", 0, 1), ("cc_delay", 1, 1),
]
PAR_FIELDS = _cols("P_", " ".join(n for n, _, _ in PARAMS))
NPAR = len(PAR_FIELDS)


class ParamError(ValueError):
    """A native parameter outside the range of 04 section 4.7 / 05 section 5.7.1."""


def params(**kw) -> np.ndarray:
    """A parameter row: defaults of 04 section 4.7 and 05 section 5.7.1, overridden in the same
    human units (us/ms/s as listed in PARAMS, reals for gains and windows)."""
    row = np.zeros(NPAR, np.int64)
    known = {n: (d, s) for n, d, s in PARAMS}
    for n in kw:
        if n not in known:
            raise ParamError(f"unknown native parameter {n!r}")
    for i, (n, d, s) in enumerate(PARAMS):
        row[i] = int(round(kw.get(n, d) * s))
    w = int(row[P_W])
    if w % 32 or not 32 <= w <= WMAX:
        raise ParamError(f"w={w}: the SACK window is a multiple of 32 in 32..{WMAX} (04 section 4.3.2)")
    if not 1 <= row[P_K] <= KMAX - 1:
        raise ParamError("k: 1..255 (MR-MP-001)")
    if not 1 <= row[P_ACK_N] <= 64:
        raise ParamError("ack_n: 1..64 (04 section 4.7)")
    if not 1 * _US <= row[P_ACK_T] <= 100 * _US:
        raise ParamError("ack_t: 1..100 us (MR-SACK-015)")
    if row[P_RTO_MIN] < 50 * _US:
        raise ParamError("rto_min: 50 us or more (MR-LOSS-005)")
    if not 3 <= row[P_DUP_THRESH] <= 64:
        raise ParamError("dup_thresh: 3..64")
    if not 0 < row[P_DELAY_FLOOR] <= row[P_W] * FP:
        raise ParamError("delay_floor: above 0, at most W packets (MR-CC-046; at or below min_cwnd: no floor)")
    return row


def rto_max_for_timeout(timeout: int) -> float:
    """rto_max in seconds for the IBTA timeout attribute (MR-LOSS-005)."""
    if timeout == 0:
        return 1.0
    return max(4.096e-6 * 2 ** timeout, 500e-6)


def new_rx(n: int = 1) -> np.ndarray:
    return np.zeros((n, NRX), np.int64)


def new_rm() -> np.ndarray:
    return np.zeros((WMAX, NRM), np.int64)


def new_tx(n: int = 1) -> np.ndarray:
    return np.zeros((n, NTX), np.int64)


def new_sb() -> np.ndarray:
    return np.zeros((WMAX, NSB), np.int64)


def new_pt() -> np.ndarray:
    return np.zeros((KMAX, NPT), np.int64)
