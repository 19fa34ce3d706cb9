/* SPDX-License-Identifier: Apache-2.0 */
/*
 * metaroce_structs.h - state shared between the XDP program and user space.
 *
 * Fixed-width types, explicit padding, static size and offset asserts, no
 * kernel-only includes (compiled by BCC and by gcc in the tests).  The Python
 * mirror is metaroce_xdp/kern/layout.py (numpy structured dtypes);
 * tests/kern/test_c_python_agree.py compares every offset.
 *
 * Single writer per field (STYLE habit 5).  Three writers share a QP slot and
 * each owns whole 64-byte cache lines or a clearly marked part of one:
 *
 *   control plane (daemon)    [0, 40)    rarely written
 *   user-space requester      [40, 64)   on every send
 *   kernel ACK fast path      [64, 192)  on every ACK/NAK
 *   reserved                  [192, 256) (see below)
 *
 * Slot lifecycle (publication protocol).  A slot is unused while qpn == 0 and
 * the kernel writes nothing to a slot whose qpn does not match the packet's
 * BTH.DestQP.  To install a QP the daemon writes qpn = 0, then initialises
 * EVERY field (the one moment it writes fields it does not own: ack_psn =
 * initial PSN - 1, snd_nxt = initial PSN, counters 0), then a store barrier,
 * then qpn.  To remove it the daemon writes qpn = 0 first.  QPN 0 is
 * therefore never a MetaRoCE QP (as in IB, where QP0 is the SMI).
 */
#ifndef __METAROCE_STRUCTS_H
#define __METAROCE_STRUCTS_H

#include <linux/types.h>
#include "metaroce_consts.h"
#include "metaroce_drop_reasons.h"  /* enum mr_drop_reason, enum mr_event */

#ifndef offsetof
#define offsetof(t, f) __builtin_offsetof(t, f)
#endif

/* QP states: the ibv_qp_state numbering. */
enum mr_qp_state_code {
	MR_QPS_RESET = 0,
	MR_QPS_INIT  = 1,
	MR_QPS_RTR   = 2,
	MR_QPS_RTS   = 3,
	MR_QPS_SQD   = 4,
	MR_QPS_SQE   = 5,
	MR_QPS_ERR   = 6,
};

/* Which states accept which packets (a bit per state, MR-QP-020).  RESET,
 * INIT and ERR accept nothing.  Requests are for the responder (RTR and later); ACKs,
 * READ responses, atomic ACKs and CNPs are for the requester, which only has
 * packets outstanding in RTS, SQD or SQE. */
#define MR_QPS_BIT(s)        (1u << (s))
#define MR_QPS_ACCEPT_REQ    (MR_QPS_BIT(MR_QPS_RTR) | MR_QPS_BIT(MR_QPS_RTS) | MR_QPS_BIT(MR_QPS_SQD))
#define MR_QPS_ACCEPT_ACK    (MR_QPS_BIT(MR_QPS_RTS) | MR_QPS_BIT(MR_QPS_SQD) | MR_QPS_BIT(MR_QPS_SQE))
/* A CNP only for a QP in RTS (MR-CNP-005, MR-CC-033, MR-QP-020). */
#define MR_QPS_ACCEPT_CNP    MR_QPS_BIT(MR_QPS_RTS)

enum mr_profile {
	MR_PROFILE_COMPAT = 0,
	MR_PROFILE_NATIVE = 1,
};

/* mr_qp_state.flags (control plane). */
#define MR_QPF_ACK_TO_USER  (1u << 0)  /* do not consume ACKs in the kernel: steer them */

struct mr_qp_state {
	/* ---- control plane (daemon) -------------------------------- [0, 40) */
	__u32 qpn;              /*  0 this QP's number; 0 = slot unused; written LAST on install */
	__u8  state;            /*  4 enum mr_qp_state_code */
	__u8  profile;          /*  5 enum mr_profile */
	__u16 flags;            /*  6 MR_QPF_* */
	__u32 dest_qpn;         /*  8 peer's QPN */
	__u16 pmtu;             /* 12 path MTU in payload bytes (256..4096) */
	__u16 pkey;             /* 14 the QP's P_Key, host order; default 0xFFFF (MR-BTH-009, MR-BTH-010) */
	__u8  peer_ip[16];      /* 16 peer address, network order; IPv4 as ::ffff:a.b.c.d (MR-SEC-009) */
	__u16 sack_ring;        /* 32 native QP: index + 1 of its mr_sacks ring, where the kernel puts its
				 *    NATIVE_SACKs (MR-SACK-043); 0 = steer them to the AF_XDP socket */
	__u16 ctrl_pad;         /* 34 */
	__u32 ctrl_rsvd;        /* 36 */

	/* ---- user-space requester ---------------------------------- [40, 64) */
	__u32 snd_nxt;          /* 40 next PSN to send; ACK PSNs must be before it */
	__u32 comp_psn;         /* 44 completer's oldest unacknowledged PSN; NAKs before it are stale (MR-ACK-015) */
	__u32 rtt_probe_psn;    /* 48 PSN whose send time is rtt_probe_ns */
	__u32 nak_read_psn;     /* 52 first PSN of the oldest READ once some of its responses are placed, the one
				 *    PSN before comp_psn a NAK may name (MR-MEM-033); MR_PSN_NONE otherwise */
	__u64 rtt_probe_ns;     /* 56 CLOCK_MONOTONIC ns when rtt_probe_psn was sent; 0 = no probe */

	/* ---- kernel ACK fast path ---------------------------------- [64, 192)
	 * Read protocol (seqcount): s1 = ack_seq; if s1 is odd, retry; read the
	 * fields; s2 = ack_seq; if s1 != s2, retry.  The kernel takes the count
	 * from even to odd with a compare-and-swap (so two CPUs never write at
	 * once: the loser drops the ACK as ACK_BUSY; ACKs are cumulative), writes,
	 * then makes it even again.  (ack_seq / 2) is the number of accepted
	 * ACK/NAK/RNR NAK packets.  ghost_acks, stale_acks, cnp_count and cnp_discarded are atomic adds
	 * outside the seqcount. */
	__u64 ack_seq;          /* 64 seqcount, odd while the kernel writes */
	__u32 ack_psn;          /* 72 highest cumulatively acknowledged PSN (snd_una - 1) */
	__u32 ack_msn;          /* 76 MSN of the last accepted ACK/NAK */
	__u32 nak_psn;          /* 80 PSN of the last NAK */
	__u32 nak_seq;          /* 84 incremented per NAK */
	__u32 rnr_psn;          /* 88 PSN of the last RNR NAK */
	__u32 rnr_seq;          /* 92 incremented per RNR NAK */
	__u8  last_syndrome;    /* 96 AETH syndrome of the last accepted ACK/NAK */
	__u8  nak_code;         /* 97 low 5 bits of the last NAK syndrome */
	__u8  rnr_timer;        /* 98 low 5 bits of the last RNR NAK syndrome */
	__u8  k_pad0;           /* 99 */
	__u32 ghost_acks;       /* 100 ACK/NAKs for a PSN at or after snd_nxt, never sent: MR-ACK-015 (a) (atomic add) */
	__u64 rtt_ns;           /* 104 last RTT sample */
	__u64 srtt_ns;          /* 112 smoothed RTT (RFC 6298, gain 1/8) */
	__u64 rttvar_ns;        /* 120 RTT variation (RFC 6298, gain 1/4) */
	__u64 acks;             /* 128 positive ACKs accepted */
	__u64 naks;             /* 136 NAKs accepted */
	__u64 rnr_naks;         /* 144 RNR NAKs accepted */
	__u64 stale_acks;       /* 152 ACK/NAKs outside their window, see mr_ack_fastpath() (atomic add) */
	__u64 cnp_count;        /* 160 valid CNPs for this QP, counted after their ICRC (atomic add; consumed here) */
	__u64 last_ack_ns;      /* 168 bpf_ktime_get_ns() of the last accepted ACK/NAK */
	__u64 cnp_discarded;    /* 176 CNPs naming this QP but dropped: wrong peer, P_Key, state or profile (MR-CC-039; atomic add) */
	__u8  k_rsvd[8];        /* 184 */

	/* ---- reserved ---------------------------------------------- [192, 256)
	 * Kernel-written QP state still to come (e.g. DCQCN rate state).  The
	 * native SACK fast path keeps its records in mr_sacks (below), not here:
	 * a SACK carries up to 156 bytes and several may wait.  Zero; writer: kernel. */
	__u8  sack_rsvd[64];    /* 192 */
};

/*
 * The NATIVE_SACK fast path (MR-SACK-043): a ring per native QP in mr_sacks,
 * an mmap-able array.  The kernel is the producer, the data plane's loop
 * (metaroce_xdp/native/plane_tx.py nat_kern_sacks) the single consumer.
 *
 * Protocol (a bounded multi-producer, single-consumer queue, one sequence
 * word per record).  A producer reads prod and cons; prod - cons ==
 * MR_SACK_RING_LEN means full: the SACK is steered to the AF_XDP socket
 * instead (counted in `full`).  Otherwise it reserves position prod with a
 * compare-and-swap prod -> prod + 1 (a lost race is steered too, `busy`),
 * writes the record at prod % MR_SACK_RING_LEN, then publishes it with a
 * fully ordered exchange rec.seq = prod + 1.  The consumer reads rec.seq at
 * cons with acquire; equal to cons + 1 means published: it reads the record,
 * then stores cons + 1 with release.  A record still being written stops the
 * consumer until its next round.  Records are never skipped, so SACKs leave
 * a ring in the order their positions were reserved.  While the consumer
 * sleeps (`sleeping`), SACKs go to the socket, whose poll() wakes it.
 *
 * Writers: kernel [0, 64) and the records; data plane [64, 128).
 */
#ifndef MR_SACK_RINGS
#define MR_SACK_RINGS 32            /* native QPs of one endpoint with a ring */
#endif
#ifndef MR_SACK_RING_LEN
#define MR_SACK_RING_LEN 32         /* records per ring; a power of two */
#endif
#define MR_SACK_RAW_MAX (12 + 4 + 12 + 4 * MR_SACK_MAX_WORDS)   /* BTH AETH SACKETH bitmap: 156 */

struct mr_sack_rec {
	__u64 seq;              /*  0 ring position + 1 once the record is whole (kernel, exchanged last) */
	__u64 ts_ns;            /*  8 bpf_ktime_get_ns() when the SACK arrived (CLOCK_MONOTONIC) */
	__u32 qpn;              /* 16 BTH.DestQP */
	__u32 len;              /* 20 bytes in raw: 28 + 4 * bitmap_words; 0 = could not be copied (discard) */
	__u8  raw[168];         /* 24 BTH, AETH, SACKETH and bitmap as received (network order) */
};

struct mr_sack_ring {
	/* ---- kernel ------------------------------------------------ [0, 64) */
	__u64 prod;             /*  0 positions reserved (compare-and-swap) */
	__u64 pushed;           /*  8 SACKs put in the ring: consumed in the kernel (atomic add) */
	__u64 full;             /* 16 SACKs steered to AF_XDP because the ring was full (atomic add) */
	__u64 busy;             /* 24 SACKs steered to AF_XDP because another CPU won the position (atomic add) */
	__u64 asleep;           /* 32 SACKs steered to AF_XDP because the loop was asleep (atomic add) */
	__u8  k_rsvd[24];       /* 40 */
	/* ---- data plane -------------------------------------------- [64, 128) */
	__u64 cons;             /* 64 next position to read (release store) */
	__u32 owner;            /* 72 QP row (qpn % MR_MAX_QPS) + 1 whose loop drains the ring; 0 = none */
	__u32 sleeping;         /* 76 1 while the owner's loop sleeps in poll(): the kernel steers the SACK to the
				 *    socket instead, which wakes the loop (a SACK must not wait in the ring) */
	__u64 drained;          /* 80 records applied to the QP */
	__u64 discarded;        /* 88 records dropped: not the owner's QPN, uncopied, or the QP's state refuses them */
	__u8  u_rsvd[32];       /* 96 */
	struct mr_sack_rec rec[MR_SACK_RING_LEN];   /* 128 */
};

_Static_assert(sizeof(struct mr_sack_rec) == 192, "mr_sack_rec is 192 bytes");
_Static_assert(MR_SACK_RAW_MAX <= sizeof(((struct mr_sack_rec *)0)->raw), "raw holds the largest SACK");
_Static_assert(offsetof(struct mr_sack_ring, cons) == 64, "consumer part starts on a cache line");
_Static_assert(offsetof(struct mr_sack_ring, rec) == 128, "records start on a cache line");
_Static_assert((MR_SACK_RING_LEN & (MR_SACK_RING_LEN - 1)) == 0, "MR_SACK_RING_LEN must be a power of two");

_Static_assert(sizeof(struct mr_qp_state) == 256, "mr_qp_state is 256 bytes");
_Static_assert(offsetof(struct mr_qp_state, snd_nxt) == 40, "requester part starts at 40");
_Static_assert(offsetof(struct mr_qp_state, ack_seq) == 64, "kernel part starts on a cache line");
_Static_assert(offsetof(struct mr_qp_state, sack_rsvd) == 192, "SACK reserve starts on a cache line");
_Static_assert((MR_MAX_QPS & (MR_MAX_QPS - 1)) == 0, "MR_MAX_QPS must be a power of two");

/* mr_config.flags */
#define MR_CFG_HAVE_IP4  (1u << 0)  /* pass IPv4 not addressed to local_ip4 */
#define MR_CFG_HAVE_IP6  (1u << 1)  /* pass IPv6 not addressed to local_ip6 */
#define MR_CFG_HAVE_MAC  (1u << 2)  /* pass frames not addressed to local_mac */

/* The endpoint's identity; one-entry array mr_cfg, written by the daemon. */
struct mr_config {
	__u32 flags;            /*  0 MR_CFG_* */
	__u8  local_ip4[4];     /*  4 network order */
	__u8  local_ip6[16];    /*  8 network order */
	__u8  local_mac[6];     /* 24 */
	__u16 pad0;             /* 30 */
	__u32 rsvd[8];          /* 32 */
};

_Static_assert(sizeof(struct mr_config) == 64, "mr_config is 64 bytes");

#endif /* __METAROCE_STRUCTS_H */
