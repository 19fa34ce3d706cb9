/* SPDX-License-Identifier: Apache-2.0 */
/*
 * metaroce_xdp.c - the MetaRoCE endpoint's XDP program (ingress).
 *
 * Role: parse, validate, update shared state, steer (STYLE habit 4).
 *
 *   parse      Ethernet [802.1Q] / IPv4 | IPv6 / UDP 4791 / BTH / ext headers
 *              (MR-ENC, MR-BTH, MR-OPC).  Anything that is not UDP/4791 for
 *              this endpoint is XDP_PASS, untouched: ARP, ICMP, SSH keep
 *              working on the same interface.
 *   validate   like rxe_recv.c: IPv4 header checksum (MR-ENC-013), the QP
 *              exists (slot qpn matches), the source is the connected peer
 *              (MR-SEC-009), the P_Key matches the QP's (MR-BTH-010), the QP
 *              state accepts this class of packet, the opcode belongs to the
 *              QP's profile (MR-ENC-032 order).  Failures
 *              are XDP_DROP with a reason (metaroce_drop_reasons.h).
 *   ACK path   compat ACKNOWLEDGE (ACK, NAK, RNR NAK) is consumed here, like
 *              rxe_comp.c's check_ack() without the WQE walk: ICRC verified,
 *              PSN window checked, mr_qp_state updated under its seqcount,
 *              XDP_DROP.  Acknowledgements never cross to user space, except
 *              a bad AETH (MR-XH-008), which the completer must fail.
 *   CNP path   a compat CNP is consumed the same way: ICRC verified, counted
 *              into the QP's cnp_count, XDP_DROP; the requester's DCQCN
 *              reaction point (metaroce_xdp/dp/cc.py) reads the count.
 *   steer      everything else valid goes to the AF_XDP socket of this RX
 *              queue (mr_xsks); no socket = drop NO_XSK.
 *
 * Multi-buffer frames: loaded with BPF_F_XDP_HAS_FRAGS (kern/loader.py), so
 * a frame larger than a page (path MTU 4096 on an MTU 9000 veth) arrives as
 * a first buffer plus fragments, data_end ending the first.  The headers are
 * parsed in the first buffer (a driver's first buffer holds far more than
 * the largest header stack; a frame whose headers are not there is dropped
 * as truncated); lengths are checked against bpf_xdp_get_buff_len(), the
 * whole frame; the ACK/CNP ICRC input is read with bpf_xdp_load_bytes(),
 * which crosses fragments.  The AF_XDP socket takes the frame in several
 * descriptors (XDP_USE_SG, metaroce_xdp/afxdp/port.py).
 *
 * ICRC: NOT checked here for data packets: a CRC over up to 4 KiB of payload
 * is a loop the verifier would have to walk byte by byte (instruction and
 * complexity limits) and user space checks it anyway with a table CRC.  The
 * ACK fast path is different: an ACKNOWLEDGE is fixed size (BTH + AETH +
 * ICRC = 20 bytes after UDP) and moves QP state that user space trusts, so a
 * corrupt ACK must not get through.  The ICRC input is then at most 64 + 8
 * bytes, and a bounded bitwise CRC-32 loop verifies it (MR-ICRC-013).  This
 * deferral is what MR-ENC-032 allows, as long as nothing depends on the
 * packet before user space has verified it.
 *
 * Neighbours: metaroce_xdp/kern/loader.py compiles this file with -D flags
 * and -I<bpf dir>, attaches it, mmaps mr_qps; metaroce_xdp/afxdp/ owns the
 * sockets in mr_xsks; tests/kern/test_xdp_golden.py runs golden packets through it.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/in.h>

#include "metaroce_consts.h"
#include "metaroce_hdr.h"
#include "metaroce_drop_reasons.h"
#include "metaroce_structs.h"
#include "parsing_helpers.h"
#include "metaroce_maps.h"

/* Compiler barrier.  The seqcount's ordering against other CPUs comes from
 * the compare-and-swap (a fully ordered BPF atomic); this only keeps clang
 * from moving plain stores across it. */
#define mr_barrier() asm volatile("" ::: "memory")
#define MR_READ_ONCE_U32(x) (*(volatile __u32 *)&(x))
#define MR_READ_ONCE_U64(x) (*(volatile __u64 *)&(x))

static __always_inline void mr_count_drop(__u32 reason)
{
	__u64 *c = mr_drops.lookup(&reason);

	if (c)
		*c += 1;  /* per-CPU slot: no atomic needed */
}

static __always_inline void mr_count_event(__u32 ev)
{
	__u64 *c = mr_events.lookup(&ev);

	if (c)
		*c += 1;
}

/* a is in [start, start + count) modulo 2^24 (spec: PSN serial arithmetic). */
static __always_inline int mr_psn_in(__u32 a, __u32 start, __u32 count)
{
	return ((a - start) & MR_PSN_MASK) < (count & MR_PSN_MASK);
}

/* ---- ICRC of an ACKNOWLEDGE (MR-ICRC-002, MR-ICRC-003) ------------------- */
static __always_inline __u32 mr_crc32_byte(__u32 crc, __u32 b)
{
	crc ^= b;
	/* Bitwise, no table.  Verifier workaround: the usual branch-free
	 * `POLY & -(crc & 1)` makes the 6.18 verifier fork its state on the
	 * AND of a [-1, 0] value, 2 states per bit, which explodes over 72
	 * bytes; a multiply by (crc & 1) is the same value and does not fork. */
#pragma unroll
	for (int k = 0; k < 8; k++)
		crc = (crc >> 1) ^ (0xEDB88320u * (crc & 1u));
	return crc;
}

/* IP + UDP + BTH + AETH lengths covered by the ICRC of an ACKNOWLEDGE. */
#define MR_ACK_ICRC_V4_LEN (20 + 8 + MR_BTH_LEN + MR_AETH_LEN)  /* 44 */
#define MR_ACK_ICRC_V6_LEN (40 + 8 + MR_BTH_LEN + MR_AETH_LEN)  /* 64 */

/* Bytes of the ICRC input replaced by 0xFF, one bit per byte offset from
 * the IP header (MR-ICRC-004 to MR-ICRC-007; metaroce_xdp/wire/icrc.py
 * masked_pseudo_header). */
#define MR_ICRC_MASK_V4 ((1ull << 1) | (1ull << 8) | (1ull << 10) | (1ull << 11) | /* TOS TTL csum */ \
			 (1ull << 26) | (1ull << 27) |                           /* UDP checksum */ \
			 (1ull << 32))                                           /* BTH byte 4 */
#define MR_ICRC_MASK_V6 ((1ull << 1) | (1ull << 2) | (1ull << 3) | (1ull << 7) |  /* TC FL hop */ \
			 (1ull << 46) | (1ull << 47) |                           /* UDP checksum */ \
			 (1ull << 52))                                           /* BTH byte 4 */

/* Verify the ICRC of an ACKNOWLEDGE whose IP header is at l3, byte l3off of
 * the frame; one copy per IP version so that the length and mask are
 * constants.
 *
 * Multi-buffer frames (this program is loaded with BPF_F_XDP_HAS_FRAGS:
 * data_end ends the first buffer only): when the ICRC input does not lie
 * whole in the first buffer, it is copied to the stack with
 * bpf_xdp_load_bytes, which reads across fragments, so the check covers
 * every byte wherever the frame was split.  An ACK always fits a driver's
 * first buffer, so the usual path reads the packet directly, as before.
 *
 * Verifier workarounds: (1) a bounded loop, NOT unrolled: unrolled, the 72
 * bytes x 8 bit steps are ~4000 instructions and BCC refuses programs over
 * 4096; (2) one bounds check of the whole range before the loop (or a
 * constant-size stack copy) and a constant loop bound: the verifier walks
 * the loop with i known exactly, so each p[i] is a constant offset inside
 * the checked range and nothing forks per iteration.  See also
 * mr_crc32_byte() for the one idiom that did fork. */
#ifndef MR_ICRC_VIA_LOAD_BYTES
#define MR_ICRC_VIA_LOAD_BYTES 0   /* 1 (tests): every frame takes the multi-buffer path */
#endif
#define MR_DEFINE_ACK_ICRC(name, LEN, MASKED, V6)                                  \
static __always_inline int name(struct xdp_md *ctx, const __u8 *l3, void *data_end, \
				__u32 l3off)                                       \
{                                                                                  \
	__u8 buf[(LEN) + MR_ICRC_SIZE];                                            \
	const __u8 *p = l3;                                                        \
	__u32 crc = 0xFFFFFFFFu, wire, i;                                          \
                                                                                   \
	if (MR_ICRC_VIA_LOAD_BYTES || l3 + (LEN) + MR_ICRC_SIZE > (const __u8 *)data_end) { \
		if (bpf_xdp_load_bytes(ctx, l3off, buf, sizeof(buf)) < 0)          \
			return 0;                                                  \
		p = buf;                                                           \
	}                                                                          \
	_Pragma("clang loop unroll(disable)")                                      \
	for (i = 0; i < 8; i++)                                                    \
		crc = mr_crc32_byte(crc, 0xFF);         /* LRH stand-in */         \
	_Pragma("clang loop unroll(disable)")                                      \
	for (i = 0; i < (LEN); i++) {                                              \
		__u32 b = p[i];                                                    \
		if (i < 64 && (((MASKED) >> (i & 63)) & 1))                        \
			b = 0xFF;           /* masks end before byte 64 */         \
		if ((V6) && i == 0)                                                \
			b |= 0x0F;                  /* keep version, mask TC */    \
		crc = mr_crc32_byte(crc, b);                                       \
	}                                                                          \
	wire = p[(LEN)] | (p[(LEN) + 1] << 8) | (p[(LEN) + 2] << 16) |             \
	       ((__u32)p[(LEN) + 3] << 24);                                        \
	return (crc ^ 0xFFFFFFFFu) == wire;     /* LSB first (MR-ICRC-010) */      \
}
MR_DEFINE_ACK_ICRC(mr_ack_icrc_ok_v4, MR_ACK_ICRC_V4_LEN, MR_ICRC_MASK_V4, 0)
MR_DEFINE_ACK_ICRC(mr_ack_icrc_ok_v6, MR_ACK_ICRC_V6_LEN, MR_ICRC_MASK_V6, 1)

/* A CNP is fixed size too (BTH + 16 reserved bytes + ICRC, MR-XH-016) and
 * moves QP state (cnp_count, which drives the sender's rate): its ICRC is
 * verified here before it is counted (MR-ENC-032, MR-BTH-022, MR-CNP-005). */
#define MR_CNP_ICRC_V4_LEN (20 + 8 + MR_BTH_LEN + MR_CNP_LEN)  /* 56 */
#define MR_CNP_ICRC_V6_LEN (40 + 8 + MR_BTH_LEN + MR_CNP_LEN)  /* 76 */
MR_DEFINE_ACK_ICRC(mr_cnp_icrc_ok_v4, MR_CNP_ICRC_V4_LEN, MR_ICRC_MASK_V4, 0)
MR_DEFINE_ACK_ICRC(mr_cnp_icrc_ok_v6, MR_CNP_ICRC_V6_LEN, MR_ICRC_MASK_V6, 1)

/* A NATIVE_SACK moves requester state too (MR-SACK-043), so its ICRC is
 * verified before it is consumed.  Its length varies with bitmap_words: the
 * ICRC input (IP + UDP + BTH + AETH + SACKETH + 0 to 32 bitmap words, at most
 * 204 bytes) is copied to the per-CPU scratch with bpf_xdp_load_bytes (which
 * crosses fragments as well) and the bounded loop stops at its end.
 * Verifier: i is exact in every iteration, the early exit leaves only dead
 * registers behind (the states prune), and len's bounds are proved before the
 * copy, so every s->b[] index is a checked offset into the map value. */
#define MR_SACK_ULEN_MIN (8 + MR_BTH_LEN + MR_AETH_LEN + MR_SACKETH_LEN + MR_ICRC_SIZE)   /* 40 */
#define MR_SACK_ULEN_MAX (MR_SACK_ULEN_MIN + 4 * MR_SACK_MAX_WORDS)                       /* 168 */
#define MR_SACK_ICRC_MAX (40 + MR_SACK_ULEN_MAX - MR_ICRC_SIZE)                             /* 204 */

static __always_inline int mr_sack_icrc_ok(struct xdp_md *ctx, __u32 l3off, __u32 ulen, int v6)
{
	__u64 masked = v6 ? MR_ICRC_MASK_V6 : MR_ICRC_MASK_V4;
	__u32 zero = 0, crc = 0xFFFFFFFFu, wire, i;
	__u64 len;              /* 64 bits: a u32 is checked in a zero-extended copy the verifier cannot link */
	struct mr_scratch *s;

	len = (v6 ? 40 : 20) + ulen - MR_ICRC_SIZE;              /* covered bytes */
	/* Verifier: hide len's origin, so that clang checks and uses this very
	 * register (it had recomputed it from a spilled ulen, bounds lost). */
	asm volatile("" : "+r"(len));
	if (len > MR_SACK_ICRC_MAX)          /* (the caller checked ulen's minimum) */
		return 0;
	s = mr_scratch.lookup(&zero);
	if (!s)
		return 0;
	if (bpf_xdp_load_bytes(ctx, l3off, s->b, len + MR_ICRC_SIZE) < 0)
		return 0;
	_Pragma("clang loop unroll(disable)")
	for (i = 0; i < 8; i++)
		crc = mr_crc32_byte(crc, 0xFF);                  /* LRH stand-in */
	_Pragma("clang loop unroll(disable)")
	for (i = 0; i < MR_SACK_ICRC_MAX; i++) {
		__u32 b;

		if (i >= len)
			break;
		b = s->b[i];
		if (i < 64 && ((masked >> (i & 63)) & 1))
			b = 0xFF;
		if (v6 && i == 0)
			b |= 0x0F;                               /* keep version, mask TC */
		crc = mr_crc32_byte(crc, b);
	}
	wire = s->b[len] | (s->b[len + 1] << 8) | (s->b[len + 2] << 16) | ((__u32)s->b[len + 3] << 24);
	return (crc ^ 0xFFFFFFFFu) == wire;                      /* LSB first (MR-ICRC-010) */
}

/*
 * The NATIVE_SACK fast path (MR-SACK-043): the SACK, its ICRC verified and
 * every check of MR-ENC-032 passed, is copied as received (BTH to the last
 * bitmap word) into its QP's ring in mr_sacks (struct mr_sack_ring: the
 * protocol), where the data plane's loop hands it to the same requester logic
 * as a SACK from the AF_XDP socket (metaroce_xdp/native/plane_tx.py nat_kern_sacks
 * -> nat_on_sack -> tx_on_sack).  Nothing of the SACK is judged here: its
 * PSN, bitmap and feedback are validated there (MR-SACK-019, MR-SACK-037),
 * against the requester state of the moment.  Returns MR_EV_SACK_CONSUMED, or
 * MR_EV_SACK_RING_FULL when the ring is full, another CPU took the position
 * or the loop is asleep: the caller steers the SACK to the AF_XDP socket
 * instead, so none is lost or left waiting.
 */
static __always_inline int mr_sack_push(struct xdp_md *ctx, struct mr_qp_state *qp, __u32 qpn,
					__u32 bth_off, __u32 ulen)
{
	__u32 ri = qp->sack_ring - 1;
	__u64 len = ulen - 8 - MR_ICRC_SIZE;                     /* 64 bits: see mr_sack_icrc_ok() */
	struct mr_sack_ring *r = mr_sacks.lookup(&ri);
	struct mr_sack_rec *e;
	__u64 prod;

	if (!r)
		return MR_EV_SACK_RING_FULL;                     /* no such ring: the socket takes it */
	if (MR_READ_ONCE_U32(r->sleeping)) {
		/* The loop sleeps in poll(): the socket's frame wakes it, a
		 * record would wait (and count as path delay in its RTT). */
		__sync_fetch_and_add(&r->asleep, 1);
		return MR_EV_SACK_RING_FULL;
	}
	prod = MR_READ_ONCE_U64(r->prod);
	if (prod - MR_READ_ONCE_U64(r->cons) >= MR_SACK_RING_LEN) {
		__sync_fetch_and_add(&r->full, 1);
		return MR_EV_SACK_RING_FULL;
	}
	if (__sync_val_compare_and_swap(&r->prod, prod, prod + 1) != prod) {
		__sync_fetch_and_add(&r->busy, 1);
		return MR_EV_SACK_RING_FULL;
	}
	/* Position prod is ours alone: its previous record (prod - LEN) was
	 * consumed, so published and no longer written. */
	e = &r->rec[prod & (MR_SACK_RING_LEN - 1)];
	e->qpn = qpn;
	e->ts_ns = bpf_ktime_get_ns();
	/* Verifier: see mr_sack_icrc_ok(); the barriers keep clang from merging
	 * the two bounds into one range test the verifier cannot follow. */
	asm volatile("" : "+r"(len));
	if (len > MR_SACK_RAW_MAX)
		len = 0;
	asm volatile("" : "+r"(len));
	if (len < MR_BTH_LEN + MR_AETH_LEN + MR_SACKETH_LEN ||
	    bpf_xdp_load_bytes(ctx, bth_off, e->raw, len) < 0)
		len = 0;                                         /* published anyway: the loop discards it */
	e->len = len;
	mr_barrier();
	__sync_lock_test_and_set(&e->seq, prod + 1);             /* publish: fully ordered exchange */
	__sync_fetch_and_add(&r->pushed, 1);
	return MR_EV_SACK_CONSUMED;
}

/* IPv4 header checksum (MR-ENC-013): the one's complement sum of the 10
 * header words, checksum included, is 0xFFFF.  The ICRC masks the checksum,
 * so nothing else protects the header.  Byte order does not matter to a
 * one's complement sum. */
static __always_inline int mr_ip4_csum_ok(void *l3, void *data_end)
{
	__u16 *w = l3;
	__u32 sum = 0;

	if ((void *)(w + 10) > data_end)     /* verifier: re-prove the bound */
		return 0;
#pragma unroll
	for (int i = 0; i < 10; i++)
		sum += w[i];
	sum = (sum & 0xFFFF) + (sum >> 16);
	sum = (sum & 0xFFFF) + (sum >> 16);
	return sum == 0xFFFF;
}

/* P_Key match (MR-BTH-010, IBTA 10.9.1.2): the low 15 bits equal and at least
 * one of the two keys a full member (bit 15).  A key whose low 15 bits are
 * zero (0x0000, 0x8000) is the invalid P_Key and never matches, whatever the
 * QP's key. */
static __always_inline int mr_pkey_ok(__u32 pkt, __u32 mine)
{
	if (!(pkt & 0x7FFF))
		return 0;
	return !((pkt ^ mine) & 0x7FFF) && ((pkt | mine) & 0x8000);
}

/* MR-ENC-015: does a chain of IPv6 extension headers, starting with header
 * type `nh` at `pos`, end in UDP to port 4791?  Then it is a MetaRoCE packet
 * carrying extension headers, which is dropped; any other chain (and a
 * non-first fragment, which has no UDP header) is not ours and passes.  At
 * most MR_IP6_EXT_MAX headers are followed: a bounded, unrolled walk. */
#ifndef MR_IP6_EXT_MAX
#define MR_IP6_EXT_MAX 4
#endif
static __always_inline int mr_ip6_ext_to_roce(void *pos, __u32 nh, void *data_end)
{
	__u8 *p = pos;
	struct udphdr *u;

#pragma unroll
	for (int i = 0; i < MR_IP6_EXT_MAX; i++) {
		__u32 len;

		if (nh != 0 && nh != 43 && nh != 44 && nh != 60)   /* HBH, routing, fragment, dest opts */
			break;
		if (p + 8 > (__u8 *)data_end)
			return 0;
		if (nh == 44) {
			if ((p[2] << 8 | p[3]) & 0xFFF8)   /* fragment offset != 0 */
				return 0;
			len = 8;
		} else {
			len = ((__u32)p[1] + 1) * 8;       /* at most 2048: bounded for the verifier */
		}
		nh = p[0];
		p += len;
	}
	if (nh != MR_IPPROTO_UDP)
		return 0;
	u = (struct udphdr *)p;
	if (u + 1 > (struct udphdr *)data_end)
		return 0;
	return u->dest == mr_htons(ROCE_UDP_PORT);
}

/* RFC 6298 smoothing, shifts only (no 64-bit division in BPF). */
static __always_inline void mr_rtt_update(struct mr_qp_state *qp, __u64 r)
{
	__u64 srtt = qp->srtt_ns, var = qp->rttvar_ns, dev;

	qp->rtt_ns = r;
	if (srtt == 0) {
		qp->srtt_ns = r;
		qp->rttvar_ns = r >> 1;
		return;
	}
	dev = srtt > r ? srtt - r : r - srtt;
	qp->rttvar_ns = var - (var >> MR_RTTVAR_SHIFT) + (dev >> MR_RTTVAR_SHIFT);
	qp->srtt_ns = srtt - (srtt >> MR_SRTT_SHIFT) + (r >> MR_SRTT_SHIFT);
}

/*
 * The first PSN that a NAK, an RNR NAK or a bad AETH may name: comp_psn, the
 * oldest unacknowledged PSN (MR-ACK-015, MR-SEC-022 as revised: comp_psn - 1
 * is stale).  The kernel knows ack_psn, so comp_psn is at least ack_psn + 1;
 * the completer publishes its own comp_psn, which is further on when READ
 * responses or ATOMIC ACKNOWLEDGEs (handled in user space) moved it.  A
 * published value outside [ack_psn + 1, snd_nxt] is older than what the
 * kernel knows and is ignored; one published late only widens the window,
 * and the completer checks again (Completer._valid_ack_psn).  The one PSN
 * before comp_psn that a NAK may name is MR-MEM-033's, the first PSN of a
 * partly answered READ (MR-ACK-015 (b)), for a NAK with a code, as
 * Completer.on_syndrome tests it.
 */
static __always_inline __u32 mr_nak_window_start(struct mr_qp_state *qp, __u32 ack, __u32 nxt,
						 __u32 syn, __u32 psn)
{
	__u32 lo = (ack + 1) & MR_PSN_MASK;
	__u32 comp = MR_READ_ONCE_U32(qp->comp_psn);

	if (mr_psn_in(comp, lo, nxt - lo + 1))
		lo = comp;
	if ((syn & MR_AETH_TYPE_MASK) == MR_AETH_NAK && (syn & MR_AETH_VALUE_MASK) &&
	    psn == MR_READ_ONCE_U32(qp->nak_read_psn))      /* MR_PSN_NONE equals no PSN */
		lo = psn;
	return lo;
}

/*
 * The ACK fast path (MR-ACK-002, MR-NAK-001, MR-RNR-002).  Returns the event
 * to count (MR_EV_*_CONSUMED), MR_EV_STEERED for a packet that only user
 * space can judge, or a negative drop reason.
 *
 * The window (MR-ACK-015, MR-SEC-022): a positive ACK acknowledges everything
 * up to its PSN p, which lies in [ack_psn, snd_nxt); p == ack_psn, a duplicate,
 * moves nothing and only takes its MSN (the credits MR-ACK-015 (c) allows).
 * A NAK or RNR NAK names the first PSN that failed, in [comp_psn, snd_nxt)
 * (mr_nak_window_start), and acknowledges everything before it.  Anything
 * else is dropped as GHOST_ACK or STALE_ACK (mr_count_outside).  ack_psn only moves forward
 * (MR-SEC-022, MR-SEC-024).
 *
 * An AETH with bit 7 set or type 10 (reserved) is a bad response (MR-XH-008):
 * the completer must fail the oldest WQE with IBV_WC_BAD_RESP_ERR (MR-NAK-012),
 * which only user space can do, so it is steered there -- once it has passed
 * the ICRC, QP, peer, P_Key and state checks and lies in the window: outside
 * it, it is stale and never moves a QP to ERR (MR-SEC-032).  Nothing is
 * written for it, so it takes no seqcount.
 */
/*
 * An ACK/NAK outside its window (MR-ACK-015): at or after snd_nxt it answers a
 * PSN never sent, a ghost, counted in ghost_acks and dropped as GHOST_ACK (user
 * space adds both to rx_ghost_rsp); anything else is stale, counted in
 * stale_acks and dropped as STALE_ACK.  Returns the drop reason, negated.
 */
static __always_inline int mr_count_outside(struct mr_qp_state *qp, __u32 psn, __u32 nxt)
{
	if (mr_psn_in(psn, nxt, 1u << 23)) {
		__sync_fetch_and_add(&qp->ghost_acks, 1);
		return -MR_DROP_GHOST_ACK;
	}
	__sync_fetch_and_add(&qp->stale_acks, 1);
	return -MR_DROP_STALE_ACK;
}

static __always_inline int mr_ack_fastpath(struct mr_qp_state *qp, struct mr_bth *bth,
					   void *data_end)
{
	struct mr_aeth *aeth = (struct mr_aeth *)(bth + 1);
	__u32 syn, psn, msn, old_ack, new_ack, nxt, kind, lo;
	__u64 seq;
	int ev;

	if (aeth + 1 > (struct mr_aeth *)data_end)   /* verifier: re-prove the bound */
		return -MR_DROP_TRUNCATED_EXT;
	syn = mr_aeth_syndrome(aeth);
	msn = mr_aeth_msn(aeth);
	psn = mr_bth_psn(bth);
	kind = syn & MR_AETH_TYPE_MASK;
	if ((syn & MR_AETH_RSVD_BIT) || kind == MR_AETH_RESERVED) {
		old_ack = MR_READ_ONCE_U32(qp->ack_psn);
		nxt = MR_READ_ONCE_U32(qp->snd_nxt);
		lo = mr_nak_window_start(qp, old_ack, nxt, syn, psn);
		if (!mr_psn_in(psn, lo, nxt - lo)) {
			return mr_count_outside(qp, psn, nxt);
		}
		return MR_EV_STEERED;
	}

	/* Take the seqcount even -> odd.  An odd count or a lost race means
	 * another CPU is updating this QP (its RX queues hash differently);
	 * drop rather than spin: ACKs are cumulative, the next one repairs it. */
	seq = MR_READ_ONCE_U64(qp->ack_seq);
	if (seq & 1)
		return -MR_DROP_ACK_BUSY;
	if (__sync_val_compare_and_swap(&qp->ack_seq, seq, seq + 1) != seq)
		return -MR_DROP_ACK_BUSY;
	mr_barrier();

	old_ack = qp->ack_psn;
	nxt = MR_READ_ONCE_U32(qp->snd_nxt);
	lo = kind == MR_AETH_ACK ? old_ack : mr_nak_window_start(qp, old_ack, nxt, syn, psn);
	if (!mr_psn_in(psn, lo, nxt - lo)) {
		/* Nothing was written: restore the count, readers see no change. */
		mr_barrier();
		__sync_val_compare_and_swap(&qp->ack_seq, seq + 1, seq);
		return mr_count_outside(qp, psn, nxt);
	}

	new_ack = (kind == MR_AETH_ACK) ? psn : ((psn - 1) & MR_PSN_MASK);
	/* Forward only: MR-MEM-033's NAK, before ack_psn + 1, would otherwise move it back. */
	if (!mr_psn_in(new_ack, old_ack, nxt - old_ack))
		new_ack = old_ack;
	qp->ack_psn = new_ack;
	qp->ack_msn = msn;
	qp->last_syndrome = syn;
	qp->last_ack_ns = bpf_ktime_get_ns();

	if (kind == MR_AETH_ACK) {
		__u64 probe_ns = MR_READ_ONCE_U64(qp->rtt_probe_ns);
		__u32 probe_psn = MR_READ_ONCE_U32(qp->rtt_probe_psn);

		qp->acks += 1;
		ev = MR_EV_ACK_CONSUMED;
		/* p == ack_psn (comp_psn - 1) is stale (MR-ACK-015 (c)): counted as
		 * such, though its MSN was taken (the credit the rule allows). */
		if (psn == old_ack)
			__sync_fetch_and_add(&qp->stale_acks, 1);
		/* RTT sample when this ACK newly covers the probe: probe in
		 * (old_ack, new_ack].  Duplicates cover nothing new. */
		if (probe_ns && mr_psn_in(probe_psn, old_ack + 1, new_ack - old_ack) &&
		    qp->last_ack_ns > probe_ns) {
			mr_rtt_update(qp, qp->last_ack_ns - probe_ns);
			mr_count_event(MR_EV_RTT_SAMPLE);
		}
	} else if (kind == MR_AETH_RNR_NAK) {
		qp->rnr_psn = psn;
		qp->rnr_timer = syn & MR_AETH_VALUE_MASK;
		qp->rnr_seq += 1;
		qp->rnr_naks += 1;
		ev = MR_EV_RNR_CONSUMED;
	} else {
		qp->nak_psn = psn;
		qp->nak_code = syn & MR_AETH_VALUE_MASK;
		qp->nak_seq += 1;
		qp->naks += 1;
		ev = MR_EV_NAK_CONSUMED;
	}

	mr_barrier();
	__sync_val_compare_and_swap(&qp->ack_seq, seq + 1, seq + 2);
	return ev;
}

/* Source address is the connected peer (MR-SEC-009, MR-SEC-021).  peer_ip is 4-byte aligned
 * (offset 16), so compare it as four words.  Each takes the L3 pointer and
 * re-checks its own bound: see `l3` in struct mr_rx. */
static __always_inline int mr_peer_ok_v4(struct mr_qp_state *qp, void *l3, void *data_end)
{
	struct iphdr *iph = l3;
	__u32 *p = (__u32 *)qp->peer_ip;

	if (iph + 1 > (struct iphdr *)data_end)
		return 0;
	return p[0] == 0 && p[1] == 0 && p[2] == mr_htonl(0x0000FFFFu) && p[3] == iph->saddr;
}

static __always_inline int mr_peer_ok_v6(struct mr_qp_state *qp, void *l3, void *data_end)
{
	struct ipv6hdr *ip6h = l3;
	__u32 *p = (__u32 *)qp->peer_ip;

	if (ip6h + 1 > (struct ipv6hdr *)data_end)
		return 0;
	return p[0] == ip6h->saddr.in6_u.u6_addr32[0] && p[1] == ip6h->saddr.in6_u.u6_addr32[1] &&
	       p[2] == ip6h->saddr.in6_u.u6_addr32[2] && p[3] == ip6h->saddr.in6_u.u6_addr32[3];
}

/*
 * What the steps of xdp_metaroce() learn about a packet, in the order they
 * learn it.
 *
 * Verifier: after mr_rx_l3() the IP header is reached only through `l3`, a
 * packet pointer on every path, and helpers that use it re-check their own
 * bound.  Keeping iph/ip6h and choosing one by a flag failed: clang folds
 * the flag back into the ethertype test, the verifier cannot correlate that
 * with which pointer is NULL, and walks a path that dereferences the NULL
 * one.
 */
struct mr_rx {
	void *data;
	void *data_end;
	struct mr_config *cfg;          /* NULL: no local addresses to match */
	__u32 cfg_flags;
	struct ethhdr *eth;
	void *l3;                       /* IPv4 or IPv6 header, as v6 says */
	int v6;
	__u32 l3off;                    /* l3's offset in the frame */
	__u32 l4len;                    /* IP payload length: UDP's must equal it */
	struct udphdr *udph;
	__u32 ulen;                     /* UDP length */
	struct mr_bth *bth;
	int opcode;
	__u32 mask;                     /* MR_OPM_* of the opcode */
	__u32 qpn;
};

/* A step's verdict besides a drop reason (> 0, enum mr_drop_reason). */
#define MR_RX_NEXT 0                    /* go on to the next step */
#define MR_RX_PASS (-1)                 /* not MetaRoCE for us: to the stack */

/* The destination is this endpoint's address, when the daemon set one. */
static __always_inline int mr_ip4_for_us(struct mr_rx *rx, struct iphdr *iph)
{
	return !(rx->cfg && (rx->cfg_flags & MR_CFG_HAVE_IP4) &&
		 iph->daddr != *(__u32 *)rx->cfg->local_ip4);
}

static __always_inline int mr_ip6_for_us(struct mr_rx *rx)
{
	struct ipv6hdr *ip6h = rx->l3;
	__u32 *l6;

	if (!rx->cfg || !(rx->cfg_flags & MR_CFG_HAVE_IP6))
		return 1;
	l6 = (__u32 *)rx->cfg->local_ip6;
	if (ip6h + 1 > (struct ipv6hdr *)rx->data_end)  /* verifier: re-prove the bound */
		return 0;
	return ip6h->daddr.in6_u.u6_addr32[0] == l6[0] &&
	       ip6h->daddr.in6_u.u6_addr32[1] == l6[1] &&
	       ip6h->daddr.in6_u.u6_addr32[2] == l6[2] &&
	       ip6h->daddr.in6_u.u6_addr32[3] == l6[3];
}

static __always_inline int mr_mac_for_us(struct mr_rx *rx)
{
	struct ethhdr *eth = rx->eth;
	struct mr_config *cfg = rx->cfg;

	return !(cfg && (rx->cfg_flags & MR_CFG_HAVE_MAC) &&
		 (eth->h_dest[0] != cfg->local_mac[0] || eth->h_dest[1] != cfg->local_mac[1] ||
		  eth->h_dest[2] != cfg->local_mac[2] || eth->h_dest[3] != cfg->local_mac[3] ||
		  eth->h_dest[4] != cfg->local_mac[4] || eth->h_dest[5] != cfg->local_mac[5]));
}

/* IPv4 to UDP 4791 for us.  Until that is known the frame may be anyone's
 * and passes; after it, refusals are drops. */
static __always_inline int mr_rx_ip4(struct xdp_md *ctx, struct mr_rx *rx,
				     struct hdr_cursor *nh)
{
	struct iphdr *iph = 0;
	struct udphdr *udph;
	int ret;

	ret = parse_iphdr(nh, rx->data_end, &iph);
	rx->l3 = iph;
	if (ret == -MR_DROP_IP_OPTIONS || ret == -MR_DROP_IP_FRAGMENT) {
		/* Options or fragments are legal IP (IGMP carries Router
		 * Alert): only refuse them when they wrap UDP/4791 for us.
		 * A non-first fragment has no UDP header to look at.
		 * (MR-ENC-009, MR-ENC-010) */
		if (iph->protocol != MR_IPPROTO_UDP ||
		    (iph->frag_off & mr_htons(0x1FFF)))
			return MR_RX_PASS;
		/* ihl is 4 bits: the verifier sees a bounded offset. */
		udph = (struct udphdr *)((void *)iph + (iph->ihl & 0xF) * 4);
		if (udph + 1 > (struct udphdr *)rx->data_end ||
		    udph->dest != mr_htons(ROCE_UDP_PORT))
			return MR_RX_PASS;
		if (!mr_ip4_for_us(rx, iph))
			return MR_RX_PASS;
		return -ret;
	}
	if (ret != MR_IPPROTO_UDP)
		return MR_RX_PASS;
	if (parse_udphdr(nh, rx->data_end, &rx->udph) != ROCE_UDP_PORT)
		return MR_RX_PASS;
	if (!mr_ip4_for_us(rx, iph))
		return MR_RX_PASS;
	rx->l4len = mr_ntohs_bounded(iph->tot_len);
	/* MR-ENC-032 step 4, after options (2) and fragments (3). */
	if (!mr_ip4_csum_ok(rx->l3, rx->data_end))
		return MR_DROP_BAD_IP_CSUM;
	/* The whole frame, every fragment: the payload may lie past data_end
	 * (the frame's length is only asked for then). */
	rx->l3off = (__u32)((void *)iph - rx->data);
	if (rx->l4len < sizeof(*iph) ||
	    ((void *)iph + rx->l4len > rx->data_end &&
	     rx->l3off + rx->l4len > (__u32)bpf_xdp_get_buff_len(ctx)))
		return MR_DROP_BAD_IP_HEADER;
	rx->l4len -= sizeof(*iph);
	return MR_RX_NEXT;
}

/* IPv6 to UDP 4791 for us, as mr_rx_ip4(). */
static __always_inline int mr_rx_ip6(struct xdp_md *ctx, struct mr_rx *rx,
				     struct hdr_cursor *nh)
{
	struct ipv6hdr *ip6h = 0;
	int ret;

	rx->v6 = 1;
	ret = parse_ip6hdr(nh, rx->data_end, &ip6h);
	rx->l3 = ip6h;
	if (ret >= 0 && ret != MR_IPPROTO_UDP) {
		/* MR-ENC-015, MR-ENC-032 step 2: extension headers in front
		 * of UDP/4791 for us are dropped as IP_OPTIONS. */
		if (!mr_ip6_ext_to_roce(nh->pos, ret, rx->data_end) || !mr_ip6_for_us(rx))
			return MR_RX_PASS;
		return MR_DROP_IP_OPTIONS;
	}
	if (ret != MR_IPPROTO_UDP)
		return MR_RX_PASS;
	if (parse_udphdr(nh, rx->data_end, &rx->udph) != ROCE_UDP_PORT)
		return MR_RX_PASS;
	if (!mr_ip6_for_us(rx))
		return MR_RX_PASS;
	rx->l4len = mr_ntohs_bounded(ip6h->payload_len);
	rx->l3off = (__u32)((void *)ip6h - rx->data);
	if ((void *)(ip6h + 1) + rx->l4len > rx->data_end &&
	    rx->l3off + sizeof(*ip6h) + rx->l4len > (__u32)bpf_xdp_get_buff_len(ctx))
		return MR_DROP_BAD_IP_HEADER;
	return MR_RX_NEXT;
}

/* Ethernet [802.1Q] / IPv4 | IPv6 / UDP 4791 for this endpoint's address
 * (MR-ENC-032 steps 1 to 4).  ARP, ICMP, SSH ... pass. */
static __always_inline int mr_rx_l3(struct xdp_md *ctx, struct mr_rx *rx,
				    struct hdr_cursor *nh)
{
	int ret, vlan;

	ret = parse_ethhdr(nh, rx->data_end, &rx->eth, &vlan);
	if (ret == mr_htons(MR_ETH_P_IP))
		return mr_rx_ip4(ctx, rx, nh);
	if (ret == mr_htons(MR_ETH_P_IPV6))
		return mr_rx_ip6(ctx, rx, nh);
	return MR_RX_PASS;                    /* truncated, ARP, LLDP, ...: not ours */
}

/* MR-ENC-007, MR-ENC-014, MR-ENC-018 lengths: IP says where the packet ends,
 * not data_end (short frames carry Ethernet padding).  Then the BTH. */
static __always_inline int mr_rx_bth(struct mr_rx *rx, struct hdr_cursor *nh)
{
	int ret;

	rx->ulen = mr_ntohs(rx->udph->len);
	if (rx->ulen != rx->l4len)
		return MR_DROP_BAD_UDP_LENGTH;
	if (rx->ulen < sizeof(struct udphdr) + MR_BTH_LEN + MR_ICRC_SIZE)
		return MR_DROP_TRUNCATED_BTH;
	ret = parse_bth(nh, rx->data_end, &rx->bth);
	if (ret < 0)
		return -ret;
	rx->opcode = ret;
	return MR_RX_NEXT;
}

/* The ICRC of the packets that move QP state in the kernel (MR-ICRC-014,
 * MR-ENC-032, MR-SACK-043); data packets have theirs checked in user space,
 * see the file comment.
 *
 * Checked right after the BTH, before any header field (DestQP, PSN) is
 * trusted, so a corrupt ACK counts as BAD_ICRC whatever QP it names.  It
 * also keeps the verifier cheap: few states reach this point, and the CRC
 * loop is walked once per state.  Only the exact ACK and CNP sizes and the
 * possible SACK sizes are checked: any other length is refused by
 * mr_rx_headers(). */
static __always_inline int mr_rx_icrc(struct xdp_md *ctx, struct mr_rx *rx)
{
#if MR_VERIFY_ACK_ICRC
	const __u8 *l3 = rx->l3;
	__u32 ulen = rx->ulen;

	/* A corrupt ACKNOWLEDGE must not move QP state. */
	if (rx->opcode == MR_OP_ACKNOWLEDGE &&
	    ulen == sizeof(struct udphdr) + MR_BTH_LEN + MR_AETH_LEN + MR_ICRC_SIZE &&
	    !(rx->v6 ? mr_ack_icrc_ok_v6(ctx, l3, rx->data_end, rx->l3off)
		     : mr_ack_icrc_ok_v4(ctx, l3, rx->data_end, rx->l3off)))
		return MR_DROP_BAD_ICRC;
	/* The same for a CNP, before cnp_count can move. */
	if (rx->opcode == MR_OP_CNP &&
	    ulen == sizeof(struct udphdr) + MR_BTH_LEN + MR_CNP_LEN + MR_ICRC_SIZE &&
	    !(rx->v6 ? mr_cnp_icrc_ok_v6(ctx, l3, rx->data_end, rx->l3off)
		     : mr_cnp_icrc_ok_v4(ctx, l3, rx->data_end, rx->l3off)))
		return MR_DROP_BAD_ICRC;
	/* And for a NATIVE_SACK, before it can be put in its QP's ring. */
	if (rx->opcode == MR_OP_NATIVE_SACK && ulen >= MR_SACK_ULEN_MIN &&
	    ulen <= MR_SACK_ULEN_MAX && !mr_sack_icrc_ok(ctx, rx->l3off, ulen, rx->v6))
		return MR_DROP_BAD_ICRC;
#endif
	return MR_RX_NEXT;
}

/* MR-OPC-001, MR-OPC-003, MR-ENC-027: the opcode table decides which headers
 * follow the BTH, and whether a payload may; UDP's length must hold them,
 * the pad and the ICRC exactly. */
static __always_inline int mr_rx_headers(struct mr_rx *rx)
{
	int hlen, rest;

	hlen = mr_opcode_info(rx->opcode, &rx->mask);
	if (hlen < 0)
		return MR_DROP_UNKNOWN_OPCODE;
	rest = (int)rx->ulen - (int)sizeof(struct udphdr) - hlen - MR_ICRC_SIZE;
	if (rest < 0)
		return MR_DROP_TRUNCATED_EXT;
	if (rx->mask & MR_OPM_SACKETH) {
		/* SACKETH follows BTH + AETH in a NATIVE_SACK. */
		struct mr_sacketh *sk = (void *)rx->bth + MR_BTH_LEN + MR_AETH_LEN;

		if (sk + 1 > (struct mr_sacketh *)rx->data_end)
			return MR_DROP_TRUNCATED_EXT;
		if (sk->bitmap_words > MR_SACK_MAX_WORDS)
			return MR_DROP_BAD_FIELD;
		rest -= 4 * sk->bitmap_words;
		if (rest < 0)
			return MR_DROP_TRUNCATED_EXT;
	}
	if (!(rx->mask & MR_OPM_PAYLOAD)) {
		if (rest != 0 || mr_bth_pad(rx->bth))
			return MR_DROP_BAD_PAD;
	} else if ((rest & 3) || (int)mr_bth_pad(rx->bth) > rest) {
		return MR_DROP_BAD_PAD;
	}
	return MR_RX_NEXT;
}

/* The QP the BTH names (MR-BTH-016): its slot holds that very QPN.  NULL if
 * none does. */
static __always_inline struct mr_qp_state *mr_rx_qp(struct mr_rx *rx)
{
	struct mr_qp_state *qp;
	__u32 slot;

	rx->qpn = mr_bth_qpn(rx->bth);
	slot = rx->qpn % MR_MAX_QPS;
	qp = mr_qps.lookup(&slot);
	if (!qp || qp->qpn == 0 || qp->qpn != rx->qpn)
		return 0;
	return qp;
}

/* Does the QP take this packet?  Like rxe_recv.c's check_type_state and
 * check_keys: the source is the connected peer (MR-SEC-009), then steps 13
 * to 15 of MR-ENC-032 in the spec's order: P_Key, state (MR-QP-020),
 * profile (MR-OPC-004).  For ACKs and CNPs the ICRC, step 12, is already
 * verified. */
static __always_inline int mr_rx_check_qp(struct mr_rx *rx, struct mr_qp_state *qp)
{
	__u32 accept;

	if (rx->v6 ? !mr_peer_ok_v6(qp, rx->l3, rx->data_end)
		   : !mr_peer_ok_v4(qp, rx->l3, rx->data_end))
		return MR_DROP_WRONG_PEER;
	if (!mr_pkey_ok(mr_ntohs(rx->bth->pkey), qp->pkey))
		return MR_DROP_BAD_PKEY;
	accept = (rx->mask & MR_OPM_REQ) ? MR_QPS_ACCEPT_REQ :
		 (rx->mask & MR_OPM_CNP) ? MR_QPS_ACCEPT_CNP : MR_QPS_ACCEPT_ACK;
	/* Bound the shift: state is a u8 the daemon writes. */
	if (qp->state > MR_QPS_ERR || !(MR_QPS_BIT(qp->state) & accept))
		return MR_DROP_QP_STATE;
	/* Step 15: native opcodes only on native QPs (MR-OPC-004); a native QP
	 * takes only 0xC0-0xC6 and the atomics 0x12-0x14 (MR-NAT-007), so a CNP
	 * there is dropped, never counted (MR-CC-026). */
	if ((rx->mask & MR_OPM_NATIVE) ? qp->profile != MR_PROFILE_NATIVE
				       : (qp->profile == MR_PROFILE_NATIVE &&
					  (rx->opcode < MR_OP_ATOMIC_ACKNOWLEDGE ||
					   rx->opcode > MR_OP_FETCH_ADD)))
		return MR_DROP_WRONG_PROFILE;
	return MR_RX_NEXT;
}

/* What the kernel consumes instead of steering, unless the QP asks for
 * everything in user space (MR_QPF_ACK_TO_USER): a NATIVE_SACK into its QP's
 * ring, a CNP into cnp_count, a compat ACKNOWLEDGE into the QP state.
 * Returns the event to count (MR_EV_*_CONSUMED), MR_EV_STEERED for a packet
 * that goes on to the socket, or a negative drop reason. */
static __always_inline int mr_rx_consume(struct xdp_md *ctx, struct mr_rx *rx,
					 struct mr_qp_state *qp)
{
	int ev;

	if (qp->flags & MR_QPF_ACK_TO_USER)
		return MR_EV_STEERED;

	/* NATIVE_SACKs are copied into the QP's ring, when it has one, for
	 * the data plane's loop (MR-SACK-043), like ACKs into the slot.  A
	 * full ring steers the SACK to the socket instead. */
	if (rx->opcode == MR_OP_NATIVE_SACK && qp->sack_ring) {
		ev = mr_sack_push(ctx, qp, rx->qpn, (__u32)((void *)rx->bth - rx->data), rx->ulen);
		if (ev == MR_EV_SACK_CONSUMED)
			return ev;
		mr_count_event(MR_EV_SACK_RING_FULL);
	}

	/* CNPs are counted into the slot, where the requester's DCQCN
	 * reaction point reads them (MR-CNP-005, MR-CNP-010,
	 * metaroce_xdp/dp/cc.py). */
	if (rx->mask & MR_OPM_CNP) {
		__sync_fetch_and_add(&qp->cnp_count, 1);
		mr_count_event(MR_EV_CNP);
		return MR_EV_CNP_CONSUMED;
	}

	/* The ACK fast path; the ICRC is already verified (mr_rx_icrc). */
	if (rx->opcode == MR_OP_ACKNOWLEDGE) {
		ev = mr_ack_fastpath(qp, rx->bth, rx->data_end);
		if (ev != MR_EV_STEERED)
			return ev;
		/* A bad AETH: on to the completer (MR-XH-008, MR-NAK-012). */
		mr_count_event(MR_EV_ACK_BAD_AETH_TO_USER);
	}
	return MR_EV_STEERED;
}

/*
 * The receive path, in steps like rxe_rcv(): parse to UDP/4791 for us,
 * check the lengths and the BTH, the ICRC of what the kernel consumes, the
 * opcode's headers, find the QP and check that it takes the packet, consume
 * it or steer it to the AF_XDP socket.  Every packet ends in exactly one
 * event (metaroce_drop_reasons.h), a drop also in its reason's counter.
 */
int xdp_metaroce(struct xdp_md *ctx)
{
	struct mr_rx rx = {
		.data = (void *)(long)ctx->data,
		.data_end = (void *)(long)ctx->data_end,
	};
	struct hdr_cursor nh = { .pos = rx.data };
	struct mr_qp_state *qp;
	__u32 zero = 0, action, event;
	int ret;

	rx.cfg = mr_cfg.lookup(&zero);
	if (rx.cfg)
		rx.cfg_flags = rx.cfg->flags;

	ret = mr_rx_l3(ctx, &rx, &nh);
	if (ret == MR_RX_PASS)
		goto pass;
	if (ret)
		goto drop;
	/* Someone else's frame: passed, but only after the IP checks above,
	 * which drop what is refused whatever its destination MAC. */
	if (!mr_mac_for_us(&rx))
		goto pass;
	ret = mr_rx_bth(&rx, &nh);
	if (ret)
		goto drop;
	ret = mr_rx_icrc(ctx, &rx);
	if (ret)
		goto drop;
	ret = mr_rx_headers(&rx);
	if (ret)
		goto drop;

	qp = mr_rx_qp(&rx);
	if (!qp) {
		ret = MR_DROP_UNKNOWN_QP;
		goto drop;
	}
	ret = mr_rx_check_qp(&rx, qp);
	if (ret) {
		/* A CNP refused by an existing QP is counted per QP as
		 * discarded (MR-CC-039), beside the port's count by reason. */
		if (rx.mask & MR_OPM_CNP)
			__sync_fetch_and_add(&qp->cnp_discarded, 1);
		goto drop;
	}

	ret = mr_rx_consume(ctx, &rx, qp);
	if (ret < 0) {
		ret = -ret;
		goto drop;
	}
	if (ret != MR_EV_STEERED) {
		action = XDP_DROP;                    /* consumed, not a drop */
		event = ret;
		goto out;
	}

	/* Steer to the AF_XDP socket of this queue.  With flags 0 a missing
	 * socket makes redirect_map return XDP_ABORTED; turn that into a
	 * counted drop instead of a trace-only abort. */
	action = mr_xsks.redirect_map(ctx->rx_queue_index, 0);
	if (action != XDP_REDIRECT) {
		ret = MR_DROP_NO_XSK;
		goto drop;
	}
	event = MR_EV_STEERED;
	goto out;

pass:
	action = XDP_PASS;
	event = MR_EV_PASSED;
	goto out;
drop:
	action = XDP_DROP;
	event = MR_EV_DROPPED;
	mr_count_drop(ret);
out:
	mr_count_event(event);
	return action;
}
