"""The responder's receive window for native READ and atomic requests (metaroce_xdp/native/receiver.py),
I/O free: a READ request records every PSN of its range (MR-OOO-003), copies are recognised by PSN alone
(MR-SACK-013), and an atomic's SACK carries no timestamp (MR-SACK-006)."""
from __future__ import annotations

import numpy as np

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
