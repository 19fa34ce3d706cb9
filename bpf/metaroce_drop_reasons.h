/* SPDX-License-Identifier: Apache-2.0 */
/*
 * metaroce_drop_reasons.h - why the XDP program dropped a packet, and what
 * else it did (cilium lib/drop_reasons.h style).
 *
 * Every drop has a named reason.  The value is also the index of its per-CPU
 * counter in mr_drops, so a reason is NEVER renumbered or reused: add new ones
 * at the end of their range.  Mirrored in metaroce_xdp/kern/layout.py
 * (DropReason), checked by tests/kern/test_c_python_agree.py.
 *
 * 1..31: the codec's DecodeReason (metaroce_xdp/wire/errors.py), same number,
 *        same name, so "why was this frame refused" has one answer in kernel
 *        and user space.  The ones marked PASS are never drops in XDP: until
 *        the frame is known to be UDP/4791 for us it may be anyone's traffic
 *        (ARP, ICMP, SSH) and goes to the stack untouched.
 * 32..:  kernel-only reasons.
 */
#ifndef __METAROCE_DROP_REASONS_H
#define __METAROCE_DROP_REASONS_H

#include "metaroce_consts.h"

enum mr_drop_reason {
	MR_DROP_NONE            = 0,   /* not a drop (counter unused) */
	/* --- codec DecodeReason values --- */
	MR_DROP_TRUNCATED_ETH   = 1,   /* PASS in XDP */
	MR_DROP_NOT_IP          = 2,   /* PASS in XDP */
	MR_DROP_TRUNCATED_IP    = 3,   /* PASS in XDP */
	MR_DROP_BAD_IP_HEADER   = 4,   /* UDP/4791 whose IP lengths disagree with the frame */
	MR_DROP_IP_OPTIONS      = 5,   /* UDP/4791 in IPv4 with options (MR-ENC-009) */
	MR_DROP_IP_FRAGMENT     = 6,   /* first fragment of UDP/4791 */
	MR_DROP_NOT_UDP         = 7,   /* PASS in XDP */
	MR_DROP_TRUNCATED_UDP   = 8,   /* PASS in XDP */
	MR_DROP_BAD_UDP_LENGTH  = 9,
	MR_DROP_NOT_ROCE_PORT   = 10,  /* PASS in XDP */
	MR_DROP_TRUNCATED_BTH   = 11,
	MR_DROP_BAD_TVER        = 12,
	MR_DROP_UNKNOWN_OPCODE  = 13,
	MR_DROP_TRUNCATED_EXT   = 14,
	MR_DROP_BAD_PAD         = 15,
	MR_DROP_BAD_FIELD       = 16,  /* e.g. SACK bitmap_words > 32 */
	MR_DROP_BAD_IP_CSUM     = 17,  /* UDP/4791 in IPv4 whose header checksum is wrong (MR-ENC-013) */
	/* 18..31 reserved for future DecodeReason values */
	/* --- kernel-only --- */
	MR_DROP_UNKNOWN_QP      = 32,  /* slot empty or slot.qpn != BTH.DestQP */
	MR_DROP_QP_STATE        = 33,  /* QP state does not accept this packet class */
	MR_DROP_WRONG_PEER      = 34,  /* source IP is not the connected peer (MR-SEC-009) */
	MR_DROP_NO_XSK          = 35,  /* no AF_XDP socket on this RX queue */
	MR_DROP_WRONG_PROFILE   = 36,  /* native opcode on a compat QP */
	MR_DROP_BAD_ICRC        = 37,  /* ACKNOWLEDGE whose ICRC does not match */
	MR_DROP_STALE_ACK       = 38,  /* ACK/NAK PSN before its window (MR-ACK-015 (b)) */
	MR_DROP_ACK_BUSY        = 39,  /* another CPU held the QP's ack seqcount */
	MR_DROP_BAD_PKEY        = 40,  /* P_Key invalid or not a member of the QP's partition (MR-BTH-010) */
	MR_DROP_GHOST_ACK       = 41,  /* ACK/NAK PSN at or after snd_nxt, never sent (MR-ACK-015 (a)) */
	MR_DROP__MAX,
};

/* Things that happened, counted per CPU in mr_events; never renumbered.
 * Every packet is exactly one of PASSED, STEERED, ACK/NAK/RNR/CNP_CONSUMED
 * or DROPPED, so their sum is the number of packets the program saw. */
enum mr_event {
	MR_EV_PASSED        = 0,  /* XDP_PASS: not MetaRoCE for this endpoint */
	MR_EV_STEERED       = 1,  /* XDP_REDIRECT to the AF_XDP socket */
	MR_EV_ACK_CONSUMED  = 2,  /* positive ACK applied to QP state */
	MR_EV_NAK_CONSUMED  = 3,  /* NAK applied */
	MR_EV_RNR_CONSUMED  = 4,  /* RNR NAK applied */
	MR_EV_DROPPED       = 5,  /* XDP_DROP with a reason in mr_drops (consumed ACKs are not drops) */
	MR_EV_RTT_SAMPLE    = 6,  /* an ACK covered rtt_probe_psn */
	MR_EV_CNP           = 7,  /* valid CNP counted in the QP's cnp_count (after its ICRC) */
	MR_EV_CNP_CONSUMED  = 8,  /* CNP consumed here (counted, then XDP_DROP; not a drop) */
	MR_EV_ACK_BAD_AETH_TO_USER = 9, /* ACKNOWLEDGE in the window whose AETH has bit 7 set or type 10
					 * (MR-XH-008): not consumed, sent on to the AF_XDP socket so the
					 * completer fails the WQE (MR-NAK-012); then STEERED (or NO_XSK) */
	MR_EV_SACK_CONSUMED = 10, /* NATIVE_SACK put in its QP's mr_sacks ring (after its ICRC), then
				   * XDP_DROP; not a drop (MR-SACK-043) */
	MR_EV_SACK_RING_FULL = 11, /* NATIVE_SACK whose ring was full or contended, or whose loop was
				    * asleep: steered to the AF_XDP socket instead; then STEERED (or NO_XSK) */
	MR_EV__MAX,
};

_Static_assert(MR_DROP__MAX <= MR_DROP_SLOTS, "mr_drops too small for the reasons");
_Static_assert(MR_EV__MAX <= MR_EVENT_SLOTS, "mr_events too small for the events");

#endif /* __METAROCE_DROP_REASONS_H */
