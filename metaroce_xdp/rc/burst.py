"""Compiled bursts for the bulk of RDMA traffic (STYLE 6: numba over numpy, no Python objects).

Hot loops, each processing many packets per call:

* `tx_segment`: the requester's segmentation of one SEND/WRITE message into
  packets (FIRST/MIDDLE/LAST/ONLY opcodes, MR-RC-002, MR-RC-003; RETH on the
  first, ImmDt on the last, MR-RC-007; AckReq every `ackreq_every` packets and
  on the last, MR-ACK-013), built straight into UMEM frames.
* `rx_write_run`: the responder's in-order WRITE MIDDLE/LAST placement for
  one QP whose WRITE context (target memory, offset, bytes left) was set up
  by the Python responder from the FIRST packet's RETH (MR-RC-010, MR-RC-011,
  MR-ICRC-013 checked per frame).  It stops at the first
  frame it cannot take without judgement (another QP, an unexpected PSN,
  opcode or length, a bad ICRC): the Python pipeline handles that frame with
  the full rules, so the fast path never decides anything the slow path
  would decide differently.
* `rx_skip_run`: the responder's duplicates and out-of-sequence SEND/WRITE
  frames after a go-back-N, counted and skipped (MR-DUP-002, MR-NAK-003)
  under the same stop-when-in-doubt rule.
* `rx_rsp_skip_run`: the completer's stale READ RESPONSEs and those after a
  lost one while the remainder is re-requested, counted and skipped
  (MR-ACK-015, MR-RETRY-013), likewise.

Each is checked against the Python transport in tests.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)

from ..wire.fastpath import _copy, build_frame, frame_icrc_ok

OP_SEND_FIRST, OP_SEND_MIDDLE, OP_SEND_LAST, OP_SEND_LAST_IMM, OP_SEND_ONLY, OP_SEND_ONLY_IMM = 0, 1, 2, 3, 4, 5
OP_WRITE_FIRST, OP_WRITE_MIDDLE, OP_WRITE_LAST, OP_WRITE_LAST_IMM, OP_WRITE_ONLY, OP_WRITE_ONLY_IMM = 6, 7, 8, 9, 10, 11
OP_READ_RESPONSE_FIRST, OP_READ_RESPONSE_ONLY = 13, 16


@njit(cache=True, nogil=True)
def segment_opcode(is_write, has_imm, k, npkts):
    """Opcode of packet k of an npkts-packet SEND or WRITE (MR-RC-003).  IBTA lays both
    families out alike -- FIRST, MIDDLE, LAST, LAST_IMM, ONLY, ONLY_IMM from a base of
    0 (SEND) or 6 (WRITE) -- so one rule serves both."""
    base = OP_WRITE_FIRST if is_write else OP_SEND_FIRST
    if npkts == 1:
        return base + (5 if has_imm else 4)
    if k == 0:
        return base
    if k == npkts - 1:
        return base + (3 if has_imm else 2)
    return base + 1


@njit(cache=True, nogil=True)
def tx_segment(tables, umem, addrs, lens, nmax, tmpl, tmpl_len, l3_off, ipv6, is_write, has_imm,
               reth, imm, data, length, pmtu, k0, npkts, psn0, ackreq_every, se_last):
    """Build packets k0, k0+1, ... (at most nmax) of one message into umem at addrs[j]; lens[j] gets
    each frame's length.  Returns the number built."""
    ext = np.empty(24, np.uint8)
    n = min(nmax, npkts - k0)
    for j in range(n):
        k = k0 + j
        last = k == npkts - 1
        first = k == 0
        ext_len = 0
        op = segment_opcode(is_write, has_imm, k, npkts)
        if is_write and first:
            for b in range(16):
                ext[b] = reth[b]
            ext_len = 16
        if last and has_imm:
            for b in range(4):
                ext[ext_len + b] = imm[b]
            ext_len += 4
        off = k * pmtu
        plen = min(pmtu, length - off)
        if plen < 0:
            plen = 0
        ack = 1 if (last or (k + 1) % ackreq_every == 0) else 0
        flags = 0x80 if (last and se_last) else 0
        psn = (psn0 + k) & 0xFFFFFF
        lens[j] = build_frame(tables, umem, addrs[j], tmpl, tmpl_len, l3_off, ipv6, op, flags, ack, psn,
                              ext, ext_len, data, off, plen)
    return n


@njit(cache=True, nogil=True)
def peek_bth(umem, addr, length):
    """(opcode, dest_qp, bth offset, ip offset) of a frame; opcode -1 when it is not IP/UDP."""
    off = addr + 14
    et = (np.int64(umem[addr + 12]) << 8) | umem[addr + 13]
    if et == 0x8100:
        et = (np.int64(umem[addr + 16]) << 8) | umem[addr + 17]
        off += 4
    l3 = off
    if et == 0x0800:
        off += 20
    elif et == 0x86DD:
        off += 40
    else:
        return -1, -1, -1, -1
    off += 8
    if off + 12 > addr + length:
        return -1, -1, -1, -1
    qpn = (np.int64(umem[off + 5]) << 16) | (np.int64(umem[off + 6]) << 8) | umem[off + 7]
    return np.int64(umem[off]), qpn, off - addr, l3 - addr


@njit(cache=True, nogil=True)
def rx_write_run(tables, umem, addrs, lens, i0, n, qpn, pmtu, mem, st):
    """Place consecutive in-order WRITE MIDDLE/LAST packets of QP `qpn`.

    st (int64[6]) in/out: [epsn, write_off, write_left, ackreq_seen, bytes, last_done].
    Returns the index of the first frame not consumed (i0 when none)."""
    i = i0
    while i < n:
        a = np.int64(addrs[i])
        ln = np.int64(lens[i])
        op, dq, boff, loff = peek_bth(umem, a, ln)
        if dq != qpn or (op != OP_WRITE_MIDDLE and op != OP_WRITE_LAST):
            break
        b = a + boff
        if umem[b + 1] & 0x0F:                       # TVer
            break
        # ECN CE: the per-packet path counts it and may send a CNP (MR-ECN-007, MR-ECN-009)
        l3 = a + loff
        if (umem[l3 + 1] >> 4 if umem[l3] >> 4 == 6 else umem[l3 + 1]) & 3 == 3:
            break
        psn = (np.int64(umem[b + 9]) << 16) | (np.int64(umem[b + 10]) << 8) | umem[b + 11]
        if psn != st[0]:
            break
        # IP length gives the frame end (Ethernet padding excluded)
        if umem[l3] >> 4 == 6:
            end = l3 + 40 + ((np.int64(umem[l3 + 4]) << 8) | umem[l3 + 5])
        else:
            end = l3 + ((np.int64(umem[l3 + 2]) << 8) | umem[l3 + 3])
        if end > a + ln:
            break
        pad = (umem[b + 1] >> 4) & 3
        plen = end - 4 - (b + 12) - pad
        left = st[2]
        if op == OP_WRITE_MIDDLE:
            if plen != pmtu or plen >= left:
                break
        else:
            if plen < 1 or plen > pmtu or plen != left:
                break
        if not frame_icrc_ok(tables, umem, a, ln):
            break
        woff = st[1]
        _copy(mem, woff, umem, b + 12, plen)
        st[0] = (psn + 1) & 0xFFFFFF
        st[1] = woff + plen
        st[2] = left - plen
        st[4] += plen
        if umem[b + 8] & 0x80:
            st[3] = 1
        i += 1
        if op == OP_WRITE_LAST:
            st[5] = 1
            break
    return i


@njit(cache=True, nogil=True)
def plain_psn(umem, a, ln, boff, loff, pkey):
    """The PSN of a frame the skip runs below may count without the per-packet path, or -1: TVer
    0, a P_Key that matches `pkey` (MR-BTH-010), no ECN CE (it may need a CNP, MR-ECN-007), and IP
    lengths that hold at least the BTH and the ICRC."""
    b = a + boff
    if umem[b + 1] & 0x0F:                           # TVer
        return -1
    pk = (np.int64(umem[b + 2]) << 8) | umem[b + 3]
    if not (pk & 0x7FFF) or (pk ^ pkey) & 0x7FFF or not ((pk | pkey) & 0x8000):
        return -1
    l3 = a + loff
    if (umem[l3 + 1] >> 4 if umem[l3] >> 4 == 6 else umem[l3 + 1]) & 3 == 3:
        return -1
    if umem[l3] >> 4 == 6:
        end = l3 + 40 + ((np.int64(umem[l3 + 4]) << 8) | umem[l3 + 5])
    else:
        end = l3 + ((np.int64(umem[l3 + 2]) << 8) | umem[l3 + 3])
    if end > a + ln or end < b + 16:                 # BTH and ICRC at least
        return -1
    return (np.int64(umem[b + 9]) << 16) | (np.int64(umem[b + 10]) << 8) | umem[b + 11]


@njit(cache=True, nogil=True)
def skip_class(tables, umem, a, ln, psn, expect, later_ok):
    """Which counter a skip run puts a frame with PSN `psn` under: 0 before `expect` (a duplicate or
    stale frame), 1 after it when `later_ok` (the rest of a stream already answered by a NAK or a
    request for the remainder), or -1 to leave it to the per-packet path: the expected PSN itself,
    a later one otherwise, or a bad ICRC."""
    d = (psn - expect) & 0xFFFFFF
    if d > 0x800000:
        d -= 0x1000000
    if d == 0 or (d > 0 and not later_ok):
        return -1
    if not frame_icrc_ok(tables, umem, a, ln):
        return -1
    return 0 if d < 0 else 1


@njit(cache=True, nogil=True)
def rx_skip_run(tables, umem, addrs, lens, i0, n, qpn, pkey, epsn, nak_sent, st):
    """Skip consecutive SEND/WRITE request frames of QP `qpn` that the responder only counts: a PSN
    before epsn (a duplicate, re-ACKed once for the run, MR-DUP-002) or, once the sequence-error NAK
    for epsn went out, after it (silently discarded, MR-NAK-003).  After a go-back-N they are most
    of what arrives; frame by frame, a responder slower than its requester took longer to drain
    them than the requester's local ACK timeout, and each expiry queued another round behind them.

    st (int64[2]) out: [duplicates, out of sequence].  Returns the index of the first frame not
    skipped.  It stops, leaving the frame to the per-packet path, at another QP or opcode, a P_Key
    that does not match (MR-BTH-010), the expected PSN, an out-of-sequence frame before the NAK,
    ECN CE (counted, maybe a CNP: MR-ECN-007), TVer != 0, a truncated frame or a bad ICRC."""
    i = i0
    while i < n:
        a = np.int64(addrs[i])
        ln = np.int64(lens[i])
        op, dq, boff, loff = peek_bth(umem, a, ln)
        if dq != qpn or op < OP_SEND_FIRST or op > OP_WRITE_ONLY_IMM:
            break
        psn = plain_psn(umem, a, ln, boff, loff, pkey)
        if psn < 0:
            break
        k = skip_class(tables, umem, a, ln, psn, epsn, nak_sent)
        if k < 0:
            break
        st[k] += 1
        i += 1
    return i


@njit(cache=True, nogil=True)
def rx_rsp_skip_run(tables, umem, addrs, lens, i0, n, qpn, pkey, first_psn, npsn, expect, retrying, st):
    """Skip consecutive READ RESPONSE frames of QP `qpn` for the READ at the head of its send queue
    (PSNs first_psn .. first_psn + npsn - 1) that the completer only counts: before the expected PSN
    (stale, MR-ACK-015 (c), MR-RETRY-009) or, while the retry from it is in progress, after it (the
    responder's old stream, MR-RETRY-013).  After each lost response such frames are most of what
    arrives; frame by frame, the requester spent far longer on them than on the data it kept.

    st (int64[2]) out: [stale, after the expected PSN].  Returns the index of the first frame not
    skipped.  Stops, leaving the frame to the per-packet path, at another QP, opcode or READ, the
    expected PSN, a later PSN while no retry is in progress, a P_Key that does not match, ECN CE
    (MR-ECN-007), TVer != 0, a truncated frame or a bad ICRC."""
    i = i0
    while i < n:
        a = np.int64(addrs[i])
        ln = np.int64(lens[i])
        op, dq, boff, loff = peek_bth(umem, a, ln)
        if dq != qpn or op < OP_READ_RESPONSE_FIRST or op > OP_READ_RESPONSE_ONLY:
            break
        psn = plain_psn(umem, a, ln, boff, loff, pkey)
        if psn < 0:
            break
        if (psn - first_psn) & 0xFFFFFF >= npsn:     # not this READ's
            break
        k = skip_class(tables, umem, a, ln, psn, expect, retrying)
        if k < 0:
            break
        st[k] += 1
        i += 1
    return i
