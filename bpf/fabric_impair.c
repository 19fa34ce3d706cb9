/* SPDX-License-Identifier: GPL-2.0 */
/* fabric_impair.c -- per-link impairments of the emulated fabric (`metaroce fabric`).
 *
 * One program object serves every switch port of a fabric built by metaroce_xdp/fabric:
 * `fab_egress` is a tc clsact egress filter (direct action) on each port, `fab_delay` a tc
 * ingress filter on both ends of each switch namespace's delay line.  A port is one
 * direction of a link: the switch-side veth end whose egress leads across it.  Ports are
 * told apart by ifindex, which the builder assigns fabric-wide (FAB_IFINDEX_BASE + port),
 * so one set of maps holds every port although the ports live in several namespaces.
 *
 * What happens to a frame on a port, in order (docs/fabric.md explains the choices):
 *   queue    a bottleneck queue in front of the link, modelled (when rate_bps != 0) as a
 *            virtual FIFO drained at rate_bps: `q_empty_ns` is the moment the queue would
 *            be empty, so its backlog in bytes is (q_empty_ns - now) * rate.  A frame that
 *            would take the backlog past drop_depth is dropped (q_dropped); one that finds
 *            more than mark_depth bytes queued is ECN CE-marked if ECT (marked; Not-ECT ones
 *            are counted in not_ect and pass), like a DCTCP-configured switch marking on the
 *            instantaneous queue.  A tbf qdisc at the same rate (set up by the builder)
 *            makes the wait real; the model decides marks and drops.
 *   loss     a seeded coin per frame: TC_ACT_STOLEN, silent like a loss on a wire (dropped)
 *   corrupt  XOR one byte of the L4 payload, past the 12-byte BTH of RoCE (corrupted)
 *   dup      bpf_clone_redirect to the same port; the clone carries FAB_MARK_DUP and passes
 *            (duplicated)
 *   reorder  the frame is held back for reorder_us on the delay line and then sent, so the
 *            frames behind it overtake it (reordered)
 * The coins are drawn from impair_mix(seed, index, salt): `index` counts the frames a port has
 * matched (its scope: every IP frame, UDP, or RoCE UDP/4791; behind up to two VLAN tags,
 * 802.1Q or 802.1ad, as in fault_inject.c), so for a given seed the
 * pattern depends only on the order in which frames reach the port
 * (metaroce_xdp/fabric/impair.py `plan` replays it, through faults.py's).
 *
 * The delay line.  This kernel has no netem, fq or etf, so nothing can hold an skb until a
 * given time.  A frame chosen for reordering gets skb->mark = FAB_MARK_HELD | port << 20 |
 * deadline (µs, 20 bits) and is redirected into a veth pair inside the switch namespace
 * (dl0 <-> dl1); fab_delay bounces it between the two ends (each pass goes through the
 * per-CPU backlog, behind whatever else arrived meanwhile) until the deadline, then
 * redirects it to its port's egress, where fab_egress lets it pass.  Marks survive a veth
 * inside one namespace (skb_scrub_packet clears them only across namespaces).  The cost is
 * CPU while frames are held: held frames x delay.
 *
 * Compile-time parameters (BCC cflags, -DNAME=value): FAB_MAX_PORTS, FAB_IFINDEX_BASE,
 * FAB_DL0_IFINDEX, FAB_DL1_IFINDEX.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/udp.h>

#include "tc_impair_common.h"

/* ---- constants ---------------------------------------------------------------------- */
#ifndef FAB_MAX_PORTS
#define FAB_MAX_PORTS 256
#endif
#ifndef FAB_IFINDEX_BASE
#define FAB_IFINDEX_BASE 1000
#endif
#ifndef FAB_DL0_IFINDEX
#define FAB_DL0_IFINDEX 990
#endif
#ifndef FAB_DL1_IFINDEX
#define FAB_DL1_IFINDEX 991
#endif

#define FAB_PPM_SCALE 1000000
#define FAB_BTH_SIZE 12
#define FAB_NSEC 1000000000ULL

/* skb->mark of frames the program emitted itself; the top nibble says which. */
#define FAB_MARK_KIND(m) ((m) >> 28)
#define FAB_KIND_DUP 0xA                /* a duplicate's clone: passes */
#define FAB_KIND_HELD 0xB               /* on or back from the delay line */
#define FAB_MARK_DUP 0xA0000000U
#define FAB_MARK_HELD 0xB0000000U
#define FAB_DEADLINE_MASK 0xFFFFFU      /* 20 bits of µs: wraps after 1.05 s */
#define FAB_PORT_SHIFT 20

/* Salts of impair_mix, one independent coin per action: never renumber.  They equal
 * fault_inject.c's FI_SALT_* (loss = drop, reorder = delay), so metaroce_xdp/faults.py's
 * plan() replays both programs; tests/kern/test_fabric.py compares. */
#define FAB_SALT_LOSS 1
#define FAB_SALT_CORRUPT 2
#define FAB_SALT_CORRUPT_OFF 3
#define FAB_SALT_DUP 4
#define FAB_SALT_REORDER 5

/* fab_cfg.scope: which frames the seeded coins act on (the queue sees every frame). */
#define FAB_SCOPE_IP 0
#define FAB_SCOPE_UDP 1
#define FAB_SCOPE_ROCE 2

/* ---- shared structs (impair.py declares the same layouts; a test compares) ---------- */
struct fab_cfg {                /* one per port; written by the CLI only (mmapped) */
	__u64 seed;             /* already mixed with the port number by the CLI */
	__u64 rate_bps;         /* bottleneck rate; 0: no queue */
	__u32 ps_per_byte;      /* 8e12 / rate_bps, rounded: the queue's drain time per byte */
	__u32 mark_depth;       /* bytes queued above which ECT frames are CE-marked; 0: never */
	__u32 drop_depth;       /* bytes the queue holds; a frame beyond is dropped; 0: no limit */
	__u32 loss_ppm;
	__u32 dup_ppm;
	__u32 reorder_ppm;
	__u32 corrupt_ppm;
	__u32 reorder_us;       /* how long a reordered frame is held */
	__u32 scope;            /* FAB_SCOPE_* */
	__u32 enabled;          /* 0: pass everything, count frames only */
};

struct fab_state {              /* one per port; written here, reset by the CLI */
	struct bpf_spin_lock lock;
	__u32 pad;
	__u64 index;            /* next matched frame's number (the coins' counter) */
	__u64 q_empty_ns;       /* bpf_ktime when the virtual queue would be empty */
	__u64 q_peak;           /* largest backlog seen, bytes (this frame included) */
};

struct fab_counters {           /* one per port and CPU; summed by the CLI */
	__u64 pkts;             /* frames through the port (own clones and held frames excluded) */
	__u64 bytes;
	__u64 matched;          /* frames in scope (each consumed one coin index) */
	__u64 q_dropped;        /* queue full: backlog + frame > drop_depth */
	__u64 marked;           /* CE set: backlog > mark_depth on an ECT frame */
	__u64 not_ect;          /* backlog > mark_depth but Not-ECT or already CE: left alone */
	__u64 dropped;          /* seeded loss */
	__u64 corrupted;
	__u64 duplicated;
	__u64 reordered;        /* sent onto the delay line */
	__u64 released;         /* came back from the delay line and left */
	__u64 bounces;          /* passes along the delay line (its CPU cost) */
	__u64 failed;           /* a helper failed (corrupt, mark, clone); the frame passed as it was */
	__u64 tx_pkts;          /* frames that left (duplicates and released frames included) */
	__u64 tx_bytes;
};

/* ---- maps --------------------------------------------------------------------------- */
BPF_F_TABLE("array", u32, struct fab_cfg, fab_cfg, FAB_MAX_PORTS, BPF_F_MMAPABLE); /* knobs; CLI writes */
BPF_ARRAY(fab_state, struct fab_state, FAB_MAX_PORTS);          /* queue and coin counter; program writes */
BPF_PERCPU_ARRAY(fab_counters, struct fab_counters, FAB_MAX_PORTS); /* outcomes; program writes */

static __always_inline int coin(__u64 seed, __u64 index, __u64 salt, __u32 ppm)
{
	if (ppm == 0)
		return 0;
	if (ppm >= FAB_PPM_SCALE)
		return 1;
	return (impair_mix(seed, index, salt) % FAB_PPM_SCALE) < ppm;
}

/* ---- parsing -------------------------------------------------------------------------
 * The header walk is parsing_helpers.h's, the XDP program's, over direct packet access
 * (impair_pull_headers makes the headers linear first).  Only offsets leave parse(): the
 * actions write through bpf_skb_store_bytes, after which packet pointers are invalid. */
struct fab_pkt {
	__u32 l3_off;
	__u32 ipv6;
	__u32 l4_off;
	__u32 l4_len;           /* L4 header + payload (IP payload length) */
	__u32 udp;
	__u32 roce;
};

/* 0 for an IPv4/IPv6 frame (fields filled), -1 for anything else. */
static __always_inline int parse(struct __sk_buff *skb, struct fab_pkt *p)
{
	void *data, *data_end;
	struct hdr_cursor nh;
	struct ethhdr *eth;
	struct udphdr *udph;
	int proto, l4proto, dport;

	impair_pull_headers(skb);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	nh.pos = data;
	proto = impair_parse_eth(&nh, data_end, &eth);
	p->l3_off = nh.pos - data;
	if (proto == mr_htons(MR_ETH_P_IP)) {
		struct iphdr *iph = NULL;
		__u32 hlen, tot;

		/* A later fragment, or options cut off by the frame's end, is
		 * still IP: it only has no L4 header to look at. */
		l4proto = parse_iphdr_any(&nh, data_end, &iph);
		if (!iph || l4proto == -MR_DROP_BAD_IP_HEADER)
			return -1;
		hlen = iph->ihl * 4;
		tot = mr_ntohs(iph->tot_len);
		p->l4_off = p->l3_off + hlen;
		p->l4_len = tot > hlen ? tot - hlen : 0;
	} else if (proto == mr_htons(MR_ETH_P_IPV6)) {
		struct ipv6hdr *ip6h;

		l4proto = parse_ip6hdr(&nh, data_end, &ip6h);  /* extension headers are not followed */
		if (l4proto < 0)
			return -1;
		p->ipv6 = 1;
		p->l4_off = p->l3_off + sizeof(*ip6h);
		p->l4_len = mr_ntohs(ip6h->payload_len);
	} else {
		return -1;
	}
	if (l4proto == MR_IPPROTO_UDP && p->l4_len >= sizeof(struct udphdr)) {
		dport = parse_udphdr(&nh, data_end, &udph);
		if (dport >= 0) {
			p->udp = 1;
			p->roce = dport == ROCE_UDP_PORT;
		}
	}
	return 0;
}

/* XOR one byte of the L4 payload: past the UDP header and, when there is room, past a
 * BTH's worth of bytes, so a RoCE frame still decodes and fails its ICRC.  Checksums are
 * left as they are: a receiver's check is what finds the damage. */
static __always_inline int corrupt(struct __sk_buff *skb, struct fab_pkt *p, __u64 seed, __u64 index)
{
	__u32 start = p->l4_off, len = p->l4_len, off;
	__u8 b;

	if (p->udp) {
		start += sizeof(struct udphdr);
		len -= sizeof(struct udphdr);
	}
	if (len == 0)
		return -1;
	if (len > FAB_BTH_SIZE)
		off = FAB_BTH_SIZE + impair_mix(seed, index, FAB_SALT_CORRUPT_OFF) % (len - FAB_BTH_SIZE);
	else
		off = impair_mix(seed, index, FAB_SALT_CORRUPT_OFF) % len;
	/* Bound the offset for the verifier: frames are below 64 KiB. */
	off = (start + off) & 0xffff;
	if (bpf_skb_load_bytes(skb, off, &b, 1) < 0)
		return -1;
	b ^= 0xff;
	return bpf_skb_store_bytes(skb, off, &b, 1, 0);
}

/* Microseconds, in the 20-bit ring the delay line's deadlines live in. */
static __always_inline __u32 now_us20(void)
{
	return (__u32)(bpf_ktime_get_ns() / 1000) & FAB_DEADLINE_MASK;
}

int fab_egress(struct __sk_buff *skb)
{
	__u32 port = skb->ifindex - FAB_IFINDEX_BASE;
	__u32 kind = FAB_MARK_KIND(skb->mark);
	struct fab_counters *c;
	struct fab_cfg *cfg;
	struct fab_state *st;
	struct fab_pkt p = {};
	__u64 index = 0, now = 0, backlog = 0, seed;
	__u32 len = skb->len;
	int ip, matched = 0, qdrop = 0, mark = 0, loss = 0, bad = 0, dup = 0, hold = 0;
	int verdict = TC_ACT_OK;

	if (port >= FAB_MAX_PORTS)
		return TC_ACT_OK;
	c = fab_counters.lookup(&port);
	cfg = fab_cfg.lookup(&port);
	st = fab_state.lookup(&port);
	if (!c || !cfg || !st)
		return TC_ACT_OK;
	if (kind == FAB_KIND_DUP || kind == FAB_KIND_HELD) {
		/* Our own: a duplicate's clone, or a held frame back from the delay line. */
		if (kind == FAB_KIND_HELD)
			c->released += 1;
		skb->mark = 0;
		goto sent;
	}
	c->pkts += 1;
	c->bytes += len;
	if (!cfg->enabled)
		goto sent;
	ip = parse(skb, &p) == 0;
	if (ip)
		matched = cfg->scope == FAB_SCOPE_IP ||
			  (cfg->scope == FAB_SCOPE_UDP && p.udp) ||
			  (cfg->scope == FAB_SCOPE_ROCE && p.roce);
	if (cfg->rate_bps)
		now = bpf_ktime_get_ns();
	seed = cfg->seed;

	bpf_spin_lock(&st->lock);
	if (matched) {
		index = st->index++;
		loss = coin(seed, index, FAB_SALT_LOSS, cfg->loss_ppm);
		bad = coin(seed, index, FAB_SALT_CORRUPT, cfg->corrupt_ppm);
		dup = coin(seed, index, FAB_SALT_DUP, cfg->dup_ppm);
		hold = coin(seed, index, FAB_SALT_REORDER, cfg->reorder_ppm);
	}
	if (cfg->rate_bps && cfg->ps_per_byte) {
		__u64 bytes = dup && !loss ? 2 * (__u64)len : len;

		if (st->q_empty_ns < now)
			st->q_empty_ns = now;
		/* (q_empty - now) stays below drop_depth's drain time, so no overflow. */
		backlog = (st->q_empty_ns - now) * 1000 / cfg->ps_per_byte;
		if (cfg->drop_depth && backlog + len > cfg->drop_depth) {
			qdrop = 1;
		} else {
			/* The frame occupies the link even if the wire then loses it. */
			st->q_empty_ns += (bytes * cfg->ps_per_byte + 500) / 1000;
			mark = cfg->mark_depth && backlog > cfg->mark_depth;
			if (backlog + bytes > st->q_peak)
				st->q_peak = backlog + bytes;
		}
	}
	bpf_spin_unlock(&st->lock);

	if (matched)
		c->matched += 1;
	if (qdrop) {
		c->q_dropped += 1;
		return TC_ACT_STOLEN;
	}
	if (mark) {
		int r = ip ? impair_mark_ce(skb, p.l3_off, p.ipv6) : 1;

		if (r == 0)
			c->marked += 1;
		else if (r > 0)
			c->not_ect += 1;
		else
			c->failed += 1;
	}
	/* Drops return TC_ACT_STOLEN: silent, like a loss on a wire. */
	if (loss) {
		c->dropped += 1;
		return TC_ACT_STOLEN;
	}
	if (bad) {
		if (corrupt(skb, &p, seed, index) == 0)
			c->corrupted += 1;
		else
			c->failed += 1;
	}
	if (dup) {
		__u32 m = skb->mark;

		/* The clone re-enters this hook carrying the mark and passes untouched. */
		skb->mark = FAB_MARK_DUP;
		if (bpf_clone_redirect(skb, skb->ifindex, 0) == 0)
			c->duplicated += 1;
		else
			c->failed += 1;
		skb->mark = m;
	}
	if (hold) {
		__u32 deadline = (now_us20() + cfg->reorder_us) & FAB_DEADLINE_MASK;

		skb->mark = FAB_MARK_HELD | (port << FAB_PORT_SHIFT) | deadline;
		c->reordered += 1;
		return bpf_redirect(FAB_DL0_IFINDEX, 0);
	}
sent:
	c->tx_pkts += 1;
	c->tx_bytes += len;
	return verdict;
}

/* tc ingress on dl0 and dl1: keep a held frame moving along the line until its deadline,
 * then send it out of its port. */
int fab_delay(struct __sk_buff *skb)
{
	__u32 m = skb->mark, port, left;
	struct fab_counters *c;

	if (FAB_MARK_KIND(m) != FAB_KIND_HELD)
		return TC_ACT_SHOT;             /* nothing else belongs on the line */
	port = (m >> FAB_PORT_SHIFT) & 0xff;
	c = fab_counters.lookup(&port);
	if (c)
		c->bounces += 1;
	left = ((m & FAB_DEADLINE_MASK) - now_us20()) & FAB_DEADLINE_MASK;
	/* Not yet due: `left` is in the first half of the ring (the second half is the past). */
	if (left != 0 && left < (FAB_DEADLINE_MASK >> 1))
		return bpf_redirect(skb->ifindex, 0);
	return bpf_redirect(FAB_IFINDEX_BASE + port, 0);
}
