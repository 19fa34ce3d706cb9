"""AF_XDP user-space ABI: constants and ctypes structs from linux/if_xdp.h.

Role: the one Python copy of the kernel's AF_XDP interface (include/uapi/linux/if_xdp.h,
as of Linux 6.18).  `xsk.py` uses it to create sockets and map rings; `rings.py` uses only
the ring flag and descriptor layout.  `tests/afxdp/test_afxdp_rings.py` checks these numbers
against the C header installed on the machine, so a typo here cannot survive.

Debian 12 ships 6.1 headers; the running kernel is newer.  Fields and flags added after
6.1 (tx_metadata_len, XDP_USE_SG, XDP_UMEM_TX_*, XDP_MAX_TX_SKB_BUDGET) are declared here
from the upstream header and are simply absent from the installed one.
"""
from __future__ import annotations

import ctypes

import numpy as np

AF_XDP = 44
PF_XDP = AF_XDP
SOL_XDP = 283

# sockaddr_xdp.sxdp_flags (bind flags)
XDP_SHARED_UMEM = 1 << 0
XDP_COPY = 1 << 1
XDP_ZEROCOPY = 1 << 2
XDP_USE_NEED_WAKEUP = 1 << 3
XDP_USE_SG = 1 << 4  # multi-buffer RX/TX: one packet may span descriptors (XDP_PKT_CONTD)

# xdp_umem_reg.flags
XDP_UMEM_UNALIGNED_CHUNK_FLAG = 1 << 0
XDP_UMEM_TX_SW_CSUM = 1 << 1
XDP_UMEM_TX_METADATA_LEN = 1 << 2

# xdp_ring_offset.flags word
XDP_RING_NEED_WAKEUP = 1 << 0

# SOL_XDP socket options
XDP_MMAP_OFFSETS = 1
XDP_RX_RING = 2
XDP_TX_RING = 3
XDP_UMEM_REG = 4
XDP_UMEM_FILL_RING = 5
XDP_UMEM_COMPLETION_RING = 6
XDP_STATISTICS = 7
XDP_OPTIONS = 8
XDP_MAX_TX_SKB_BUDGET = 9

# xdp_options.flags
XDP_OPTIONS_ZEROCOPY = 1 << 0

# mmap page offsets selecting which ring a mapping of the socket fd returns
XDP_PGOFF_RX_RING = 0
XDP_PGOFF_TX_RING = 0x80000000
XDP_UMEM_PGOFF_FILL_RING = 0x100000000
XDP_UMEM_PGOFF_COMPLETION_RING = 0x180000000

# unaligned-chunk mode packs an offset into the top 16 bits of an address
XSK_UNALIGNED_BUF_OFFSET_SHIFT = 48
XSK_UNALIGNED_BUF_ADDR_MASK = (1 << XSK_UNALIGNED_BUF_OFFSET_SHIFT) - 1

# xdp_desc.options
XDP_PKT_CONTD = 1 << 0
XDP_TX_METADATA = 1 << 1

# Not in if_xdp.h but part of the contract: in copy mode the kernel places RX data this
# far past the chunk start (plus the UMEM headroom).  Only informative: always use desc.addr.
XDP_PACKET_HEADROOM = 256


class sockaddr_xdp(ctypes.Structure):
    _fields_ = [
        ("sxdp_family", ctypes.c_uint16),
        ("sxdp_flags", ctypes.c_uint16),
        ("sxdp_ifindex", ctypes.c_uint32),
        ("sxdp_queue_id", ctypes.c_uint32),
        ("sxdp_shared_umem_fd", ctypes.c_uint32),
    ]


class xdp_ring_offset(ctypes.Structure):
    _fields_ = [
        ("producer", ctypes.c_uint64),
        ("consumer", ctypes.c_uint64),
        ("desc", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


class xdp_mmap_offsets(ctypes.Structure):
    _fields_ = [
        ("rx", xdp_ring_offset),
        ("tx", xdp_ring_offset),
        ("fr", xdp_ring_offset),  # fill
        ("cr", xdp_ring_offset),  # completion
    ]


class xdp_umem_reg(ctypes.Structure):
    # 32 bytes.  Before 6.8 the last 4 bytes were padding that had to be zero, so one
    # zero-initialised 32-byte struct is accepted by every kernel since 5.4 (flags).
    _fields_ = [
        ("addr", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("chunk_size", ctypes.c_uint32),
        ("headroom", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("tx_metadata_len", ctypes.c_uint32),
    ]


# The pre-5.4 layout ended after headroom; the kernel accepts it as "v1".
XDP_UMEM_REG_V1_SIZE = 24


class xdp_statistics(ctypes.Structure):
    _fields_ = [
        ("rx_dropped", ctypes.c_uint64),
        ("rx_invalid_descs", ctypes.c_uint64),
        ("tx_invalid_descs", ctypes.c_uint64),
        ("rx_ring_full", ctypes.c_uint64),
        ("rx_fill_ring_empty_descs", ctypes.c_uint64),
        ("tx_ring_empty_descs", ctypes.c_uint64),
    ]


class xdp_options(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint32)]


class xdp_desc(ctypes.Structure):
    _fields_ = [
        ("addr", ctypes.c_uint64),
        ("len", ctypes.c_uint32),
        ("options", ctypes.c_uint32),
    ]


# The same descriptor as a numpy record, for readable inspection of RX/TX rings.  The hot
# path uses a (n, 2) uint64 view instead: word 0 = addr, word 1 = len | options << 32
# (little-endian), which numba handles without record types.
XDP_DESC_DTYPE = np.dtype([("addr", "<u8"), ("len", "<u4"), ("options", "<u4")])
assert XDP_DESC_DTYPE.itemsize == ctypes.sizeof(xdp_desc) == 16
