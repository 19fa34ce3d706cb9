"""The responder's receive window for native READ and atomic requests (metaroce_xdp/native/receiver.py),
I/O free: a READ request records every PSN of its range (MR-OOO-003), copies are recognised by PSN alone
(MR-SACK-013), and an atomic's SACK carries no timestamp (MR-SACK-006)."""
from __future__ import annotations

import numpy as np
import pytest

from metaroce_xdp.native import layout as L
from metaroce_xdp.native.receiver import (RX_DUP, RX_NEW, RX_SACK_NOW, rx_build_sack, rx_init, rx_on_packet,
                                          rx_on_range, rx_recorded)


def _rx(epsn=0xFFFFF0, **kw):
    par = L.params(**kw)
    r = L.new_rx()[0]
    rx_init(r, par, epsn)
    return r, par


def test_read_request_records_its_whole_range_across_the_psn_wrap():
    """MR-OOO-003, MR-NAT-016: a READ request at the ePSN for 20 PSNs moves the ePSN past all 20 (across
    2^24); every PSN of the range is then a copy (MR-SACK-013), the next one is not."""
    r, par = _rx()
    out = rx_on_range(r, par, 0xFFFFF0, 20, 1, 0, 1, 77, 0xC001, 1000)
    assert out & RX_NEW and out & RX_SACK_NOW          # AckReq: a SACK now (MR-SACK-014)
    assert r[L.R_EPSN] == (0xFFFFF0 + 20) & L.PSN_MASK
    assert all(rx_recorded(r, par, (0xFFFFF0 + i) & L.PSN_MASK) for i in range(20))
    assert not rx_recorded(r, par, (0xFFFFF0 + 20) & L.PSN_MASK)
    assert rx_on_packet(r, par, 0xFFFFF5, 0, 0, 1, 78, 0xC001, 1001) & RX_DUP


def test_read_request_beyond_a_gap_is_reported_in_the_bitmap_and_fills_it_later():
    """MR-SACK-010/004: a READ request for PSNs 5-9 arriving before PSNs 0-4 is recorded beyond the ePSN
    (bitmap bits 4-8: bit i is cum + 2 + i); when 0-4 arrive the ePSN passes 9 at once."""
    r, par = _rx(epsn=100)
    rx_on_range(r, par, 105, 5, 1, 0, 1, 1, 0xC000, 0)
    assert r[L.R_EPSN] == 100 and rx_recorded(r, par, 109) and not rx_recorded(r, par, 104)
    hdr, words = np.zeros(8, np.int64), np.zeros(32, np.int64)
    assert rx_build_sack(r, par, hdr, words) == 1 and hdr[0] == 99
    assert words[0] == sum(1 << (31 - i) for i in range(4, 9))
    for p in range(100, 105):
        rx_on_packet(r, par, p, 0, 0, 1, 2, 0xC000, 1)
    assert r[L.R_EPSN] == 110 and r[L.R_NREC] == 0


def test_atomic_request_sack_has_no_timestamp():
    """MR-SACK-006, MR-NAT-006: a SACK triggered by an atomic (no NETH) has flags.N and tsecr 0."""
    r, par = _rx(epsn=7)
    rx_on_range(r, par, 7, 1, 1, 0, 0, 0, 0xC002, 0)
    hdr, words = np.zeros(8, np.int64), np.zeros(32, np.int64)
    rx_build_sack(r, par, hdr, words)
    assert hdr[0] == 7 and hdr[2] == 0 and hdr[6] == 0x40


def test_read_response_pacing_shares_the_link_among_pending_qps_mr_cc_021():
    """MR-CC-021 (native/rdpace.py): a QP with READ responses pending sends at the link rate divided by
    the port's QPs with responses pending -- 1, 2 and 4 of them give it R, R/2 and R/4 -- the count
    follows the QPs as they gain and finish their responses (no scan), and a packet that must wait for
    the QP's clock is counted once."""
    from metaroce_xdp.native import rdpace as P
    R = 200_000_000                                   # 200 Mb/s; a 1250-byte packet takes 50 us at R
    assert [P.rpace_share(R, n) for n in (1, 2, 4)] == [R, R // 2, R // 4]
    assert [P.rpace_gap(R, n, 1250) for n in (1, 2, 4)] == [50_000, 100_000, 200_000]
    assert P.rpace_share(R, 0) == R and P.rpace_gap(0, 3, 1250) == 0
    rps = [np.zeros(P.NRP, np.int64) for _ in range(4)]
    npend = 0
    for rp in rps:                                    # four QPs gain responses, one at a time
        npend += P.rpace_pending(rp, 1)
    assert npend == 4 and P.rpace_pending(rps[0], 1) == 0          # still pending: no change
    now = 1_000_000
    for rp in rps:
        assert P.rpace_may_send(rp, R, now)
        P.rpace_on_sent(rp, R, npend, 1250, 1, now)
        assert rp[P.RP_NEXT] == now + 200_000 and rp[P.RP_SHARE] == R // 4
    rp = rps[0]
    assert not P.rpace_may_send(rp, R, now + 199_999) and not P.rpace_may_send(rp, R, now + 199_999)
    assert rp[P.RP_C_WAIT] == 1                       # one packet waited, counted once
    assert P.rpace_may_send(rp, R, now + 200_000)
    # QPs finish: the count goes down 4 -> 3 -> 2 -> 1 and QP 0's gap with it
    t = now + 200_000
    for left, done in ((3, rps[3]), (2, rps[2]), (1, rps[1])):
        npend += P.rpace_pending(done, 0)
        assert npend == left
        assert P.rpace_may_send(rp, R, t)
        P.rpace_on_sent(rp, R, npend, 1250, 1, t)
        assert rp[P.RP_NEXT] == t + 50_000 * left and rp[P.RP_SHARE] == R // left
        t = int(rp[P.RP_NEXT])
    assert P.rpace_pending(rps[1], 0) == 0            # already counted out
    npend += P.rpace_pending(rp, 0)
    assert npend == 0
    assert rp[P.RP_SHARE_MIN] == R // 4 and rp[P.RP_C_PACED] == 4 and rp[P.RP_C_SHARED] == 3
    assert rp[P.RP_C_WAIT] == 1 and rp[P.RP_WAIT] == 0


def test_read_response_pacing_bursts_and_long_run_share_mr_cc_021():
    """MR-CC-021 with MR-CC-004's burst: after an idle spell up to max_burst packets leave back to back,
    then the clock binds; over a simulated 20 ms two backlogged QPs polled every 7 us each get half of
    the link (within one burst) and never more; rate 0 is not paced."""
    from metaroce_xdp.native import rdpace as P
    R, size, burst = 200_000_000, 1250, 8
    rp = np.zeros(P.NRP, np.int64)
    P.rpace_pending(rp, 1)
    now, sent = 10_000_000, 0
    while P.rpace_may_send(rp, R, now):
        P.rpace_on_sent(rp, R, 1, size, burst, now)
        sent += 1
    assert sent == burst and rp[P.RP_C_WAIT] == 1
    a, b = np.zeros(P.NRP, np.int64), np.zeros(P.NRP, np.int64)
    npend = P.rpace_pending(a, 1) + P.rpace_pending(b, 1)
    nbytes = [0, 0]
    t0 = t = 50_000_000
    while t < t0 + 20_000_000:                        # simulated time, polled as a loop would
        for i, rp in enumerate((a, b)):
            while P.rpace_may_send(rp, R, t):
                P.rpace_on_sent(rp, R, npend, size, burst, t)
                nbytes[i] += size
        t += 7_000
    fair = (R // 2) * 20_000_000 // P.NS_BITS         # bytes R/2 carries in 20 ms
    for nb in nbytes:
        assert fair <= nb <= fair + (burst + 1) * size, (nbytes, fair)
    z = np.zeros(P.NRP, np.int64)
    assert all(P.rpace_may_send(z, 0, 0) for _ in range(3)) and z[P.RP_C_WAIT] == 0


@pytest.mark.compiles        # nat_job and jb_unqueued with the test's own argument types
def test_reread_skips_response_psns_still_queued_mr_ooo_022():
    """MR-OOO-022 (native/plane_read.py jb_unqueued, nat_job): of a re-requested range, only the response PSNs
    that no queued job of the same READ (PSN and MSN) still has to send are queued again -- the PSNs a
    job has sent (below JB_I) are, those still to go ([JB_I, JB_IEND)) are not; another READ's job
    covers nothing; the job ring's indices may run past its size."""
    from metaroce_xdp.native import plane_read as R
    from metaroce_xdp.native import plane_slot as N
    A = np.zeros(N.O_JB + N.NJB * N.JB_STRIDE, np.int64)
    nx = np.zeros(N.NNX, np.int64)
    nx[N.X_JB_HEAD] = nx[N.X_JB_TAIL] = N.NJB - 1                  # the next rows wrap around the ring
    assert R.nat_job(A, nx, 0, N.K_READ, 500, 0, 8, 9, 0, 8192, 0, 0, 0, 0, 0)      # another READ
    assert R.nat_job(A, nx, 0, N.K_READ, 100, 0, 24, 3, 0, 24576, 0, 0, 0, 0, 0)    # this one, 24 PSNs
    x = N.O_JB + (N.NJB % N.NJB) * N.JB_STRIDE                     # the second job's row (index NJB)
    A[x + N.JB_I] = 8                                              # ... has sent 0-7
    assert R.jb_unqueued(A, nx, 0, 100, 3, 8, 24) == (24, 24)      # all still queued
    assert R.jb_unqueued(A, nx, 0, 100, 3, 3, 24) == (3, 8)        # 3-7 sent: those go again
    assert R.jb_unqueued(A, nx, 0, 100, 4, 3, 24) == (3, 24)       # another MSN: nothing queued
    assert R.nat_job(A, nx, 0, N.K_READ, 100, 3, 8, 3, 0, 24576, 0, 1, 0, 0, 0)     # the re-request's job
    assert R.jb_unqueued(A, nx, 0, 100, 3, 0, 24) == (0, 3)
    assert R.jb_unqueued(A, nx, 0, 100, 3, 3, 24) == (24, 24)
    A[x + N.JB_I] = 20
    assert R.jb_unqueued(A, nx, 0, 100, 3, 3, 24) == (8, 20)       # the queued copy covers 3-7
