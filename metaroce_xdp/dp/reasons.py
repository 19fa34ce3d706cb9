"""Why a QP went to ERR: the code the compiled plane keeps in the QP's row (layout.Q_ERR) and its text, which
`qp.query()["error"]`, the QP's `error_reason`, async events and `metaroce qp show` report.

`Why` names every code, TEXT says each in words (the one table); the compiled code uses the plain ints below
(module constants are compile-time constants to numba).  Codes 11..13 are 10 + the NAK code the peer sent.
"""
from __future__ import annotations

import enum


class Why(enum.IntEnum):
    CQ_OVERFLOW = 1
    RETRY_EXHAUSTED = 2
    RNR_RETRY_EXHAUSTED = 3
    BAD_RESPONSE = 4
    LOCAL_MR_DEREGISTERED = 5
    PEER_NAK_INVALID_REQUEST = 11          # 10 + NAK code 1
    PEER_NAK_REMOTE_ACCESS = 12            # 10 + NAK code 2
    PEER_NAK_REMOTE_OPERATIONAL = 13       # 10 + NAK code 3
    OPCODE_SEQUENCE = 21
    REMOTE_ACCESS = 22
    PAYLOAD_LENGTH = 23
    SEND_TOO_LONG = 24
    RECV_MR_INVALID = 26
    ATOMIC_NOT_ALLOWED = 27
    ATOMIC_UNALIGNED = 28
    INVALIDATE_REFUSED = 29
    SGE_LOCAL_CHECK = 30
    IMMDT_DIFFERS = 31
    ACCESS_OR_DMA_LENGTH = 32
    LOCAL_LENGTH = 33                      # MR-RC-008
    RD_ATOMIC_NOT_ALLOWED = 34             # MR-RC-009
    RESPONDER_RESOURCES = 35               # MR-DUP-007
    RSN_INVALID = 36                       # MR-OOO-026 (native)
    MODIFIED_TO_ERR = 100                  # the application moved it (modify); no event owed
    DESTROYED = 101
    BAD_WORK_REQUEST = 200                 # metaroced: the client wrote an invalid work request into its ring
    CLIENT_GONE = 201                      # metaroced: the owning client exited
    DAEMON_STOPPING = 202                  # metaroced: the daemon is stopping


TEXT = {
    Why.CQ_OVERFLOW: "its CQ overflowed",
    Why.RETRY_EXHAUSTED: "retries exhausted (local ACK timeout)",
    Why.RNR_RETRY_EXHAUSTED: "RNR retries exhausted",
    Why.BAD_RESPONSE: "bad response (an ACK or READ response the requester cannot take: reserved AETH, wrong "
                      "kind or sequence)",
    Why.LOCAL_MR_DEREGISTERED: "a local MR was deregistered under a posted work request (MR-MEM-035)",
    Why.PEER_NAK_INVALID_REQUEST: "the peer NAKed an invalid request",
    Why.PEER_NAK_REMOTE_ACCESS: "the peer NAKed a remote access error",
    Why.PEER_NAK_REMOTE_OPERATIONAL: "the peer NAKed a remote operational error",
    Why.OPCODE_SEQUENCE: "invalid request: opcode out of sequence",
    Why.REMOTE_ACCESS: "remote access violation (key, PD, access or bounds)",
    Why.PAYLOAD_LENGTH: "invalid request: wrong payload length",
    Why.SEND_TOO_LONG: "a SEND longer than the receive buffer",
    Why.RECV_MR_INVALID: "the receive buffer's MR was deregistered, or its SGE failed the local checks",
    Why.ATOMIC_NOT_ALLOWED: "invalid request: an ATOMIC the QP's access flags do not allow",
    Why.ATOMIC_UNALIGNED: "invalid request: ATOMIC address not 8-byte aligned",
    Why.INVALIDATE_REFUSED: "invalid request: SEND WITH INVALIDATE of a key that cannot be invalidated",
    Why.SGE_LOCAL_CHECK: "a work request's SGE failed the local checks (lkey, PD, bounds, LOCAL_WRITE)",
    Why.IMMDT_DIFFERS: "invalid request: an ImmDt that differs from an earlier packet of the same message",
    Why.ACCESS_OR_DMA_LENGTH: "invalid request: a READ or WRITE the QP's access flags do not allow, or a DMA "
                              "Length above 2^31",
    Why.LOCAL_LENGTH: "a work request's SGEs add up to more than 2^31 bytes (MR-RC-008)",
    Why.RD_ATOMIC_NOT_ALLOWED: "a READ or ATOMIC on a QP whose max_rd_atomic is 0 (MR-RC-009)",
    Why.RESPONDER_RESOURCES: "invalid request: a READ or ATOMIC beyond the responder resources (max_dest_rd_atomic, "
                             "MR-DUP-007)",
    Why.RSN_INVALID: "invalid request: an RSN that another incomplete message holds, or that differs from an "
                     "earlier packet of its message (native, MR-OOO-026)",
    Why.MODIFIED_TO_ERR: "moved to ERR by modify",
    Why.DESTROYED: "destroyed",
    Why.BAD_WORK_REQUEST: "invalid work request",
    Why.CLIENT_GONE: "its client exited",
    Why.DAEMON_STOPPING: "the daemon is stopping",
}
assert set(TEXT) == set(Why)


def text(code: int) -> str:
    """The words for a Q_ERR code (an unknown one as 'code N')."""
    try:
        return TEXT[Why(code)]
    except ValueError:
        return f"code {code}"


# for compiled code
WHY_CQ_OVERFLOW = int(Why.CQ_OVERFLOW)
WHY_RETRY_EXHAUSTED = int(Why.RETRY_EXHAUSTED)
WHY_RNR_RETRY_EXHAUSTED = int(Why.RNR_RETRY_EXHAUSTED)
WHY_BAD_RESPONSE = int(Why.BAD_RESPONSE)
WHY_LOCAL_MR_DEREGISTERED = int(Why.LOCAL_MR_DEREGISTERED)
WHY_PEER_NAK = 10                                # + the NAK code
WHY_OPCODE_SEQUENCE = int(Why.OPCODE_SEQUENCE)
WHY_REMOTE_ACCESS = int(Why.REMOTE_ACCESS)
WHY_PAYLOAD_LENGTH = int(Why.PAYLOAD_LENGTH)
WHY_SEND_TOO_LONG = int(Why.SEND_TOO_LONG)
WHY_RECV_MR_INVALID = int(Why.RECV_MR_INVALID)
WHY_ATOMIC_NOT_ALLOWED = int(Why.ATOMIC_NOT_ALLOWED)
WHY_ATOMIC_UNALIGNED = int(Why.ATOMIC_UNALIGNED)
WHY_INVALIDATE_REFUSED = int(Why.INVALIDATE_REFUSED)
WHY_SGE_LOCAL_CHECK = int(Why.SGE_LOCAL_CHECK)
WHY_IMMDT_DIFFERS = int(Why.IMMDT_DIFFERS)
WHY_ACCESS_OR_DMA_LENGTH = int(Why.ACCESS_OR_DMA_LENGTH)
WHY_LOC_LEN = int(Why.LOCAL_LENGTH)
WHY_RD_ATOMIC_0 = int(Why.RD_ATOMIC_NOT_ALLOWED)
WHY_RESPONDER_RESOURCES = int(Why.RESPONDER_RESOURCES)
WHY_RSN_INVALID = int(Why.RSN_INVALID)
WHY_MODIFIED_TO_ERR = int(Why.MODIFIED_TO_ERR)
WHY_BAD_WORK_REQUEST = int(Why.BAD_WORK_REQUEST)
