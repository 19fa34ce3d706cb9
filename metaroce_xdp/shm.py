"""Shared memory between metaroced and its clients: sealed memfds and the ring layouts in them.

Everything here is an array of little-endian int64 words, mapped MAP_SHARED by both sides:

  session header (one per client connection, made by the daemon)
      H_MAGIC, H_SLEEPING (daemon: its loop may sleep -- a post then writes the doorbell eventfd),
      H_RDY_TAIL (client) / H_RDY_HEAD (daemon): the client's doorbell ring of QP numbers,
      N_RDY words at H_RDY_OFF.  One ring per client: each has exactly one producer.
  QP rings (one memfd per QP, made by the daemon)
      QH_SQ_TAIL / QH_RQ_TAIL (client), QH_SQ_HEAD / QH_RQ_HEAD (daemon: entries taken), QH_STATE and
      QH_ERR (daemon mirrors the QP's state), then the send ring (SQE_WORDS per entry) and the
      receive ring (RQE_WORDS per entry).
  CQ ring (one memfd per CQ, made by the daemon)
      CH_TAIL (daemon), CH_HEAD (client), CH_SIZE, then CQE_WORDS per completion.

The daemon never trusts a word a client can write: indexes are masked, counts bounded, and every
entry is validated before it reaches the data plane (metaroce_xdp/dp/serve.py, the daemon's compiled loop).
Every memfd is sealed against shrinking (F_SEAL_SHRINK), so no side can make the other's accesses
fault by truncating it.  Only numpy and the standard library: clients import this without numba.
It sits beside dp/ and daemon/, not in either: the daemon (daemon/server.py), its clients
(daemon/client.py) and the compiled loop that serves them (dp/serve.py, whose machine code freezes
these word numbers: jitcache.DEPENDS_FILES) all read it, and dp/ imports nothing from daemon/.
"""
from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np

MAGIC = 0x4D52_4443_0001            # "MRDC" v1

# ---- session header --------------------------------------------------------------------
H_MAGIC, H_SLEEPING, H_RDY_TAIL, H_RDY_HEAD, H_SESSION = 0, 1, 2, 3, 4
H_RDY_OFF = 16
N_RDY = 4096                        # power of two
H_WORDS = H_RDY_OFF + N_RDY

# ---- QP rings ----------------------------------------------------------------------------
QH_SQ_TAIL, QH_SQ_HEAD, QH_RQ_TAIL, QH_RQ_HEAD, QH_STATE, QH_SQ_SIZE, QH_RQ_SIZE, QH_QPN, QH_ERR = range(9)
QH_WORDS = 16
# send entry: wr_id opcode flags laddr length lkey raddr rkey imm, then an atomic's compare_add (the add
# value of FETCH_ADD) and swap (then spare words)
S_WR_ID, S_OPCODE, S_FLAGS, S_LADDR, S_LENGTH, S_LKEY, S_RADDR, S_RKEY, S_IMM, S_COMPARE_ADD, S_SWAP = range(11)
SQE_WORDS = 16
# receive entry: wr_id laddr length lkey
R_WR_ID, R_LADDR, R_LENGTH, R_LKEY = range(4)
RQE_WORDS = 4

# ---- CQ ring -----------------------------------------------------------------------------
CH_TAIL, CH_HEAD, CH_SIZE, CH_OVERFLOW = range(4)
CH_WORDS = 8
# completion: wr_id status opcode byte_len qp_num imm flags
CQE_WORDS = 8

PAGE = mmap.PAGESIZE
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def qp_words(sq_size: int, rq_size: int) -> int:
    return QH_WORDS + sq_size * SQE_WORDS + rq_size * RQE_WORDS


def cq_words(size: int) -> int:
    return CH_WORDS + size * CQE_WORDS


def round_page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def create(nbytes: int, name: str = "metaroce", hugepages: bool = False) -> int:
    """A memfd of nbytes (rounded up to the page), zero-filled and sealed against shrinking and growing.
    hugepages=True uses 2 MiB pages (MFD_HUGETLB; nbytes rounded to 2 MiB) -- OSError when none are free."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    if hugepages:
        flags |= os.MFD_HUGETLB
        nbytes = (nbytes + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    else:
        nbytes = round_page(max(nbytes, 1))
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sealed_size(fd: int) -> int:
    """The size of a memfd that can no longer shrink; ValueError (with the reason) otherwise."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ValueError("the descriptor is not a memfd (only sealed memfds can be registered)") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ValueError("the memfd is not sealed against shrinking (F_SEAL_SHRINK): the daemon would fault "
                         "if it were truncated; allocate it with Context.alloc_buf()")
    return os.fstat(fd).st_size


def map_fd(fd: int, nbytes: int, offset: int = 0) -> mmap.mmap:
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)


def words(mm: mmap.mmap) -> np.ndarray:
    return np.frombuffer(mm, dtype=np.int64)


def close_map(mm: mmap.mmap | None) -> None:
    if mm is None:
        return
    try:
        mm.close()
    except BufferError:
        pass                     # a view still exists: the mapping goes when the last view does
