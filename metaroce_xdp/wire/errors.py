"""Typed codec errors.

Every failure to decode carries a `reason` from `DecodeReason`: the same names
(and numbers) the XDP program uses for its drop counters, so "why was this
packet refused" has one answer in kernel and user space.
"""
from __future__ import annotations

import enum


class DecodeReason(enum.IntEnum):
    """Why a frame is not a well-formed MetaRoCE packet.  Never renumber."""

    OK = 0
    TRUNCATED_ETH = 1
    NOT_IP = 2
    TRUNCATED_IP = 3
    BAD_IP_HEADER = 4        # version/IHL/length inconsistent
    IP_OPTIONS = 5           # MR-ENC-009: IPv4 options are not allowed
    IP_FRAGMENT = 6
    NOT_UDP = 7
    TRUNCATED_UDP = 8
    BAD_UDP_LENGTH = 9
    NOT_ROCE_PORT = 10
    TRUNCATED_BTH = 11
    BAD_TVER = 12
    UNKNOWN_OPCODE = 13
    TRUNCATED_EXT = 14       # extension headers + ICRC do not fit
    BAD_PAD = 15             # pad count larger than payload / payload on a no-payload opcode
    BAD_FIELD = 16           # a field value the spec forbids (e.g. SACK bitmap_words > 32)
    BAD_IP_CSUM = 17         # MR-ENC-013: the IPv4 header checksum is wrong


class CodecError(Exception):
    """Base of every error the codec raises on purpose."""


class MalformedPacket(CodecError, ValueError):
    """The bytes are not a well-formed MetaRoCE packet.

    `reason` is a DecodeReason; `offset` the byte offset where decoding stopped.
    """

    def __init__(self, reason: DecodeReason, detail: str = "", offset: int | None = None):
        self.reason = DecodeReason(reason)
        self.detail = detail
        self.offset = offset
        msg = self.reason.name.lower()
        if detail:
            msg += f": {detail}"
        if offset is not None:
            msg += f" (at byte {offset})"
        super().__init__(msg)


class NotMetaRoCE(MalformedPacket):
    """A well-formed frame that is simply not MetaRoCE (not IP/UDP/4791).

    Tools skip these; the XDP program passes them to the kernel stack.
    """


class EncodeError(CodecError, ValueError):
    """Fields given to an encoder cannot be put on the wire (out of range, wrong headers)."""
