"""READ response pacing at the native responder (05-congestion.md, MR-CC-021).

I/O free.  A port has one link rate R (bits per second; 0: not paced) and a count N of its QPs
with responses pending (READ responses or ATOMIC_ACKNOWLEDGEs queued), kept incrementally: a QP
changes it by rpace_pending()'s result when its queue turns non-empty or empty, so nothing scans the
QPs.  Each QP with responses pending may send at R / N: a pacing clock `next` (ns) that every
response packet of b bytes on the wire advances by b * 8 / (R / N), after which the next packet
waits until `next` <= now.  As the requester's pacing (MR-CC-004, dp/native.py pace_slack), up to
max_burst packets may leave back to back: the clock is never behind now by more than
(max_burst - 1) packet gaps.  The order of the responses is not the pacer's business: the responder
sends its jobs in PSN order (MR-OOO-017) and only delays the next one.

Row `rp` (RP_FIELDS) per QP; the data plane keeps R and N in words its RX-queue loops share
(dp/native.py, PW_*), N updated with an atomic add of rpace_pending()'s result.

  rpace_pending(rp, pending)        the QP's queue is (not) empty now: -1, 0 or +1 for N
  rpace_share(rate, npend)          R / N, the QP's response rate now (bits/s)
  rpace_gap(rate, npend, nbytes)    the clock's advance for a packet of nbytes (ns)
  rpace_may_send(rp, rate, now)     may the next response packet leave now?
  rpace_on_sent(rp, rate, npend, nbytes, burst, now)   after one left: advance the clock, count
"""
from __future__ import annotations

from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)
from ..jitcache import lazy_njit  # noqa: E402  (explicit signatures, compiled or loaded at first use)

_jit = dict(cache=True, nogil=True)

# pend: 1 while the QP is counted in N; next: the pacing clock (ns); wait: the packet at the head is
# waiting (counted once in c_wait); c_wait: packets that waited for the clock; c_paced: packets sent
# under pacing; c_shared: ... of which while N >= 2; share, share_min: R / N at the last packet, the
# least seen (bits/s, 0: none yet)
RP_FIELDS = "pend next wait c_wait c_paced c_shared share share_min".split()
for _i, _n in enumerate(RP_FIELDS):
    globals()["RP_" + _n.upper()] = _i
NRP = 8
assert len(RP_FIELDS) <= NRP
NS_BITS = 8_000_000_000          # ns per second * bits per byte


@lazy_njit("int64(int64[::1], int64)", **_jit)
def rpace_pending(rp, pending):
    """The QP has responses pending (1) or not (0) now: what N changes by (-1, 0, +1)."""
    p = 1 if pending != 0 else 0
    d = p - rp[RP_PEND]
    rp[RP_PEND] = p
    if p == 0:
        rp[RP_WAIT] = 0
    return d


@lazy_njit("int64(int64, int64)", **_jit)
def rpace_share(rate, npend):
    """MR-CC-021: a QP's share of the link among the npend QPs with responses pending (itself one)."""
    return rate // max(1, npend)


@lazy_njit("int64(int64, int64, int64)", **_jit)
def rpace_gap(rate, npend, nbytes):
    """The time nbytes take at rate / npend (ns): nbytes * 8 / (rate / npend), rounded up."""
    if rate <= 0:
        return 0
    return (nbytes * NS_BITS * max(1, npend) + rate - 1) // rate


@lazy_njit("boolean(int64[::1], int64, int64)", **_jit)
def rpace_may_send(rp, rate, now):
    """The next response packet may leave now (no pacing, or the clock allows it); a refusal counts
    the packet in c_wait once."""
    if rate <= 0 or rp[RP_NEXT] <= now:
        return True
    if rp[RP_WAIT] == 0:
        rp[RP_WAIT] = 1
        rp[RP_C_WAIT] += 1
    return False


@lazy_njit("void(int64[::1], int64, int64, int64, int64, int64)", **_jit)
def rpace_on_sent(rp, rate, npend, nbytes, burst, now):
    """A response packet of nbytes (on the wire) left while npend QPs had responses pending: the clock
    advances by its gap at rate / npend from no earlier than (burst - 1) gaps before now."""
    rp[RP_WAIT] = 0
    if rate <= 0:
        return
    gap = rpace_gap(rate, npend, nbytes)
    t = now - max(0, burst - 1) * gap
    if rp[RP_NEXT] > t:
        t = rp[RP_NEXT]
    rp[RP_NEXT] = t + gap
    sh = rpace_share(rate, npend)
    rp[RP_SHARE] = sh
    if rp[RP_SHARE_MIN] == 0 or sh < rp[RP_SHARE_MIN]:
        rp[RP_SHARE_MIN] = sh
    rp[RP_C_PACED] += 1
    if npend >= 2:
        rp[RP_C_SHARED] += 1
