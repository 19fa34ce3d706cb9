/* SPDX-License-Identifier: GPL-2.0 */
/* fault_inject.c -- seeded fault injector for MetaRoCE end-to-end tests.
 *
 * A tc clsact filter (direct action) on one end of a test veth.  It acts only
 * on UDP/4791 frames (IPv4 or IPv6, at most two 802.1Q/802.1ad tags in the
 * data); everything else passes untouched.  For each UDP/4791 frame it draws
 * independent per-action coins from a counter-based hash of (seed, packet
 * index, action), so the fault pattern is a pure function of the seed and
 * the order in which frames reach the hook.  metaroce_xdp/faults.py loads this
 * file with BCC, owns the maps and mirrors the hash (impair_mix, tc_impair_common.h) in Python so a
 * test can predict exactly which packets are hit.
 *
 * Actions, in the order they are applied to one frame:
 *   psn_once  drop if the BTH PSN is in fi_psn_once with a count left
 *   drop      TC_ACT_STOLEN (silent to the sender, like a loss on a wire)
 *   corrupt   XOR one byte at or after the BTH (the ICRC no longer matches)
 *   ecn_ce    set ECN CE (11) on an ECN-capable frame (ECT 01/10), fixing the
 *             IPv4 header checksum, as a congested switch does (RFC 3168);
 *             the ICRC masks both fields, so it stays valid (MR-ICRC-004)
 *   dup       bpf_clone_redirect() to the same device and direction
 *   delay     copy the frame to user space (fi_delayed perf buffer) and steal
 *             it; user space sends it again after delay_us.  This kernel has
 *             neither sch_fq nor sch_etf, so EDT (skb->tstamp) cannot delay.
 *   spread    (egress, spread_queues N > 1) every UDP/4791 frame leaves on TX
 *             queue index % N, round robin (one QP's consecutive packets on
 *             every queue: the worst case), or with FI_F_SPREAD_FLOW on the queue
 *             its UDP source port hashes to (a NIC's RSS over ports: a compat QP
 *             on one queue, a native QP's sprayed paths on several) -- on veth
 *             the peer receives it on the RX queue of that number.  A TX queue
 *             chosen at tc egress is kept (the kernel skips its own pick);
 *             skb->queue_mapping written here is the queue number plus one.
 *
 * Frames carrying skb->mark == FI_MARK (our clones, user-space reinjections)
 * pass untouched, which is what keeps dup and delay from looping.
 *
 * Compile-time parameters (BCC cflags, -DNAME=value):
 *   FI_MARK            skb->mark of frames the injector emitted itself
 *   FI_PSN_ONCE_MAX    entries in the PSN list
 *   FI_INGRESS         1 when attached on ingress (clones go to ingress)
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/udp.h>

#include "tc_impair_common.h"

/* ---- constants ---------------------------------------------------------- */
#ifndef FI_MARK
#define FI_MARK 0x4d52fa17
#endif
#ifndef FI_PSN_ONCE_MAX
#define FI_PSN_ONCE_MAX 1024
#endif
#ifndef FI_INGRESS
#define FI_INGRESS 0
#endif

#define FI_PPM_SCALE 1000000
#define FI_BTH_SIZE 12

/* Action salts for impair_mix: never renumber (faults.py SALT_* mirrors them). */
#define FI_SALT_DROP 1
#define FI_SALT_CORRUPT 2
#define FI_SALT_CORRUPT_OFF 3
#define FI_SALT_DUP 4
#define FI_SALT_DELAY 5
#define FI_SALT_ECN_CE 6

/* fi_config.flags */
#define FI_F_ENABLED (1U << 0)        /* 0: pass everything, count nothing but seen */
#define FI_F_OPCODE_FILTER (1U << 1)  /* act only on opcodes set in opcode_bitmap */
#define FI_F_FIX_UDP_CSUM (1U << 2)   /* corrupt: keep a non-zero UDP checksum valid */
#define FI_F_SPREAD_FLOW (1U << 3)    /* spread_queues: by the UDP source port's hash, not round robin */

/* Counter indices: one per outcome, doubling as the fi_counters key.
 * Never renumber; faults.py COUNTERS lists the names in this order and
 * tests/kern/test_faults.py proves the two agree. */
enum fi_counter {
	FI_C_SEEN = 0,          /* every frame through the hook */
	FI_C_OWN,               /* carried FI_MARK: our clone or reinjection, passed */
	FI_C_ROCE,              /* UDP/4791 frames (each consumes one packet index) */
	FI_C_MATCHED,           /* ... that passed the opcode filter and every_nth */
	FI_C_PSN_DROPPED,       /* dropped by the PSN list */
	FI_C_DROPPED,           /* dropped by drop_ppm */
	FI_C_CORRUPTED,         /* one byte flipped */
	FI_C_DUPLICATED,        /* clone sent */
	FI_C_DUP_FAILED,        /* bpf_clone_redirect failed; original still sent */
	FI_C_DELAYED,           /* copied to user space and stolen */
	FI_C_DELAY_FAILED,      /* perf output failed; frame passed undelayed */
	FI_C_LIMITED,           /* would have acted but action_limit was reached */
	FI_C_SHORT,             /* UDP/4791 but too short for a BTH; passed */
	FI_C_CE_MARKED,         /* ECT frame marked CE */
	FI_C_CE_NOT_ECT,        /* chosen for CE but Not-ECT or already CE: left alone */
	FI_C__MAX,
};

/* ---- shared structs (layout read by faults.py through BCC's ctypes) ---- */
struct fi_config {
	__u64 seed;
	__u32 drop_ppm;
	__u32 dup_ppm;
	__u32 corrupt_ppm;
	__u32 delay_ppm;
	__u32 flags;            /* FI_F_* */
	__u32 every_nth;        /* 0/1: every matching frame; N: the Nth, 2Nth, ... */
	__u32 action_limit;     /* 0: unlimited; else at most this many acted-on frames */
	__s32 corrupt_offset;   /* byte offset from the BTH start; < 0: seeded choice */
	__u32 corrupt_xor;      /* XOR applied to the chosen byte (low 8 bits, 0 -> 0xff) */
	__u32 delay_us;         /* informative: user space holds delayed frames this long */
	__u64 opcode_bitmap[4]; /* bit n set: opcode n is targeted */
	__u32 ecn_ce_ppm;       /* mark CE on this share of ECT frames */
	__u32 spread_queues;    /* > 1: UDP/4791 frames leave on TX queue index % spread_queues */
};

/* Serialised by a spin lock rather than atomic fetch-add: BCC's LLVM 14
 * backend rejects using the XADD return value ("Invalid usage of the XADD
 * return value"). */
struct fi_state {
	struct bpf_spin_lock lock;
	__u32 pad;
	__u64 index;            /* next UDP/4791 packet index (the PRNG counter) */
	__u64 matched;          /* frames that passed the opcode filter, for every_nth */
	__u64 acted;            /* frames acted on, for action_limit */
};

/* Prepended to each delayed frame in fi_delayed. */
struct fi_delay_meta {
	__u64 ktime_ns;         /* bpf_ktime_get_ns() when stolen (CLOCK_MONOTONIC) */
	__u64 index;            /* packet index */
	__u32 len;              /* frame bytes that follow */
	__u32 ifindex;
};

/* ---- maps -------------------------------------------------------------- */
BPF_ARRAY(fi_config, struct fi_config, 1);          /* the knobs; written by faults.py only */
BPF_ARRAY(fi_state, struct fi_state, 1);            /* PRNG counter etc.; written here, reset by faults.py */
BPF_PERCPU_ARRAY(fi_counters, __u64, FI_C__MAX);    /* outcomes; written here, summed by faults.py */
BPF_HASH(fi_psn_once, __u32, __s32, FI_PSN_ONCE_MAX); /* PSN -> drops left; faults.py fills, we decrement */
BPF_PERF_OUTPUT(fi_delayed);                        /* delayed frames, to faults.py's reinjector */

static __always_inline void count(__u32 idx)
{
	__u64 *c = fi_counters.lookup(&idx);

	if (c)
		*c += 1;
}

static __always_inline int coin(struct fi_config *cfg, __u64 index, __u64 salt, __u32 ppm)
{
	if (ppm == 0)
		return 0;
	if (ppm >= FI_PPM_SCALE)
		return 1;
	return (impair_mix(cfg->seed, index, salt) % FI_PPM_SCALE) < ppm;
}

/* ---- parsing ------------------------------------------------------------
 * The header walk is parsing_helpers.h's, the XDP program's, over direct
 * packet access (impair_pull_headers makes the headers linear first).  Only
 * offsets leave parse_roce: the actions write through bpf_skb_store_bytes,
 * after which packet pointers are invalid. */
struct fi_pkt {
	__u32 l3_off;           /* IP header, from the start of the frame */
	__u32 ipv6;
	__u32 udp_off;          /* from the start of the frame */
	__u32 udp_len;          /* UDP length field: header + payload, no L2 padding */
	__u32 sport;            /* UDP source port, host order */
	__u32 bth_off;
	__u8 opcode;
	__u32 psn;
};

/* Returns 0 and fills *p for a UDP/4791 frame, -1 for anything else. */
static __always_inline int parse_roce(struct __sk_buff *skb, struct fi_pkt *p)
{
	void *data, *data_end;
	struct hdr_cursor nh;
	struct ethhdr *eth;
	struct iphdr *iph;
	struct ipv6hdr *ip6h;
	struct udphdr *udph;
	struct mr_bth *bth;
	int proto;

	impair_pull_headers(skb);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	nh.pos = data;
	proto = impair_parse_eth(&nh, data_end, &eth);
	p->l3_off = nh.pos - data;
	p->ipv6 = proto == mr_htons(MR_ETH_P_IPV6);
	/* Options are skipped; only a first fragment carries the UDP header;
	 * IPv6 extension headers are not followed (MR-ENC forbids them). */
	if (proto == mr_htons(MR_ETH_P_IP))
		proto = parse_iphdr_any(&nh, data_end, &iph);
	else if (proto == mr_htons(MR_ETH_P_IPV6))
		proto = parse_ip6hdr(&nh, data_end, &ip6h);
	else
		return -1;
	if (proto != MR_IPPROTO_UDP)
		return -1;
	if (parse_udphdr(&nh, data_end, &udph) != ROCE_UDP_PORT)
		return -1;
	p->udp_off = (void *)udph - data;
	p->udp_len = mr_ntohs(udph->len);
	p->sport = mr_ntohs(udph->source);
	p->bth_off = nh.pos - data;
	/* Any TVer: a BTH the receiver refuses is still a frame to act on. */
	proto = parse_bth(&nh, data_end, &bth);
	if (p->udp_len < sizeof(*udph) + FI_BTH_SIZE ||
	    (proto < 0 && proto != -MR_DROP_BAD_TVER)) {
		p->opcode = 0;
		p->psn = 0;
		p->udp_len = 0;
		return 0;
	}
	p->opcode = bth->opcode;
	p->psn = mr_bth_psn(bth);
	return 0;
}

static __always_inline int opcode_selected(struct fi_config *cfg, __u8 opcode)
{
	__u32 word = opcode >> 6;

	if (!(cfg->flags & FI_F_OPCODE_FILTER))
		return 1;
	/* A switch instead of cfg->opcode_bitmap[word]: keeps the map-value
	 * access at a constant offset for the verifier. */
	switch (word) {
	case 0: return (cfg->opcode_bitmap[0] >> (opcode & 63)) & 1;
	case 1: return (cfg->opcode_bitmap[1] >> (opcode & 63)) & 1;
	case 2: return (cfg->opcode_bitmap[2] >> (opcode & 63)) & 1;
	default: return (cfg->opcode_bitmap[3] >> (opcode & 63)) & 1;
	}
}

/* XOR one byte of the UDP payload (the BTH is byte 0) so the ICRC fails. */
static __always_inline int corrupt(struct __sk_buff *skb, struct fi_config *cfg,
				   struct fi_pkt *p, __u64 index)
{
	__u32 plen = p->udp_len - sizeof(struct udphdr);   /* BTH .. ICRC */
	__u32 off;
	__u8 xor = cfg->corrupt_xor & 0xff;
	__u16 oldw, neww;
	__u32 wpos;

	if (plen == 0)
		return -1;
	if (cfg->corrupt_offset >= 0) {
		off = cfg->corrupt_offset;
		if (off >= plen)
			off = plen - 1;
	} else if (plen > FI_BTH_SIZE) {
		/* Past the BTH so the frame still decodes; the ICRC may be hit too. */
		off = FI_BTH_SIZE + impair_mix(cfg->seed, index, FI_SALT_CORRUPT_OFF) % (plen - FI_BTH_SIZE);
	} else {
		off = impair_mix(cfg->seed, index, FI_SALT_CORRUPT_OFF) % plen;
	}
	if (xor == 0)
		xor = 0xff;
	/* The 16-bit checksum word holding the byte; UDP starts on an even
	 * offset of the checksummed data, and RoCE UDP lengths are even. */
	wpos = p->bth_off + (off & ~1U);
	if (bpf_skb_load_bytes(skb, wpos, &oldw, 2) < 0)
		return -1;
	/* Wire byte 0 of the word is its low byte in host (little-endian) order;
	 * shifting a mask avoids pointer arithmetic on the stack slot. */
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	neww = oldw ^ (__u16)((off & 1) ? (__u16)xor << 8 : xor);
#else
	neww = oldw ^ (__u16)((off & 1) ? xor : (__u16)xor << 8);
#endif
	if (bpf_skb_store_bytes(skb, wpos, &neww, 2, 0) < 0)
		return -1;
	if (cfg->flags & FI_F_FIX_UDP_CSUM)
		/* BPF_F_MARK_MANGLED_0: a zero (absent) IPv4 UDP checksum stays zero. */
		bpf_l4_csum_replace(skb, p->udp_off + offsetof(struct udphdr, check),
				    oldw, neww, 2 | BPF_F_MARK_MANGLED_0);
	return 0;
}

int fi_tc(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct fi_config *cfg;
	struct fi_state *st;
	struct fi_pkt p = {};
	__u64 index;
	__s32 *left = NULL;
	int matched = 0, limited = 0, psn_hit = 0, drop = 0, bad = 0, dup = 0, delay = 0, ce = 0;
	int verdict = TC_ACT_OK;

	count(FI_C_SEEN);
	if (skb->mark == FI_MARK) {
		count(FI_C_OWN);
		goto out;
	}
	cfg = fi_config.lookup(&zero);
	st = fi_state.lookup(&zero);
	if (!cfg || !st || !(cfg->flags & FI_F_ENABLED))
		goto out;
	if (parse_roce(skb, &p) < 0)
		goto out;
	count(FI_C_ROCE);
	if (p.udp_len)
		left = fi_psn_once.lookup(&p.psn);   /* a helper call: not allowed under the lock */
	bpf_spin_lock(&st->lock);
	index = st->index++;
	if (p.udp_len && opcode_selected(cfg, p.opcode)) {
		matched = 1;
		if (cfg->every_nth > 1)
			matched = (++st->matched % cfg->every_nth) == 0;
	}
	if (matched) {
		psn_hit = left && *left > 0;
		drop = coin(cfg, index, FI_SALT_DROP, cfg->drop_ppm);
		bad = coin(cfg, index, FI_SALT_CORRUPT, cfg->corrupt_ppm);
		dup = coin(cfg, index, FI_SALT_DUP, cfg->dup_ppm);
		delay = coin(cfg, index, FI_SALT_DELAY, cfg->delay_ppm);
		ce = coin(cfg, index, FI_SALT_ECN_CE, cfg->ecn_ce_ppm);
		if ((psn_hit || drop || bad || dup || delay || ce) && cfg->action_limit) {
			if (st->acted >= cfg->action_limit)
				limited = 1;
			else
				st->acted++;
		}
		if (psn_hit && !limited)
			*left -= 1;
	}
	bpf_spin_unlock(&st->lock);

	if (!FI_INGRESS && cfg->spread_queues > 1) {
		__u64 key = cfg->flags & FI_F_SPREAD_FLOW ? (__u64)((p.sport * 0x9E3779B1U) >> 16) : index;

		skb->queue_mapping = (__u32)(key % cfg->spread_queues) + 1;
	}
	if (!p.udp_len) {
		count(FI_C_SHORT);
		goto out;
	}
	if (!matched)
		goto out;
	count(FI_C_MATCHED);
	if (limited) {
		count(FI_C_LIMITED);
		goto out;
	}
	/* Drops return TC_ACT_STOLEN, not TC_ACT_SHOT: SHOT surfaces as ENOBUFS
	 * to the sending socket, while a loss on a wire is silent. */
	if (psn_hit) {
		count(FI_C_PSN_DROPPED);
		verdict = TC_ACT_STOLEN;
		goto out;
	}
	if (drop) {
		count(FI_C_DROPPED);
		verdict = TC_ACT_STOLEN;
		goto out;
	}
	if (bad && corrupt(skb, cfg, &p, index) == 0)
		count(FI_C_CORRUPTED);
	if (ce) {
		int r = impair_mark_ce(skb, p.l3_off, p.ipv6);

		if (r == 0)
			count(FI_C_CE_MARKED);
		else if (r > 0)
			count(FI_C_CE_NOT_ECT);
	}
	if (dup) {
		__u32 mark = skb->mark;

		/* The clone inherits the mark, so when it re-enters this
		 * hook it passes untouched instead of being re-rolled. */
		skb->mark = FI_MARK;
		if (bpf_clone_redirect(skb, skb->ifindex, FI_INGRESS ? BPF_F_INGRESS : 0) == 0)
			count(FI_C_DUPLICATED);
		else
			count(FI_C_DUP_FAILED);
		skb->mark = mark;
	}
	if (delay) {
		struct fi_delay_meta m = {
			.ktime_ns = bpf_ktime_get_ns(),
			.index = index,
			.len = skb->len,
			.ifindex = skb->ifindex,
		};
		int rc;

		/* BCC rewrites perf_submit_skb into a statement, so the
		 * result cannot be tested inline. */
		rc = fi_delayed.perf_submit_skb(skb, skb->len, &m, sizeof(m));
		if (rc == 0) {
			count(FI_C_DELAYED);
			verdict = TC_ACT_STOLEN;
		} else {
			count(FI_C_DELAY_FAILED);
		}
	}
out:
	return verdict;
}
