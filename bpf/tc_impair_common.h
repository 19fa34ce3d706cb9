/* SPDX-License-Identifier: GPL-2.0 */
/*
 * tc_impair_common.h - what the two tc impairment programs share: the seeded
 * counter-based PRNG (so a fault schedule is a function of seed and packet index,
 * reproduced in user space by metaroce_xdp/faults.py), the header walk (the XDP
 * program's parsing_helpers.h, over direct packet access) and ECN CE marking.
 *
 * Included by fault_inject.c (the veth tests' injector) and fabric_impair.c (the
 * emulated fabric's switch ports); both are compiled by BCC with -I bpf/.
 */
#ifndef __TC_IMPAIR_COMMON_H
#define __TC_IMPAIR_COMMON_H

#include "parsing_helpers.h"

/* splitmix64 finaliser over (seed, index, salt): a counter-based PRNG, so no
 * state is shared between CPUs beyond the index itself. */
static __always_inline __u64 impair_mix(__u64 seed, __u64 index, __u64 salt)
{
	__u64 z = seed + index * 0x9E3779B97F4A7C15ULL + salt * 0xD1B54A32D192ED03ULL;

	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
	return z ^ (z >> 31);
}

/* The deepest header stack the tc programs read, from the start of the frame:
 * Ethernet, two VLAN tags, IPv4 with 40 bytes of options, UDP, BTH. */
#define IMPAIR_HDR_MAX (14 + MR_VLAN_MAX_DEPTH * 4 + 60 + 8 + MR_BTH_LEN)

/* Make the first IMPAIR_HDR_MAX bytes of the frame (all of it, if shorter)
 * readable between skb->data and skb->data_end.  On egress the headers of a
 * frame built by AF_PACKET or of a GSO skb, and a forwarded frame's, need not
 * all be in the linear area.  Pulls only when they are not: pulling also
 * makes a cloned skb's head private, a copy for every TCP segment (TCP keeps
 * a clone of each).  Packet pointers taken before the call are invalid after
 * it. */
static __always_inline void impair_pull_headers(struct __sk_buff *skb)
{
	__u32 want = skb->len;

	if (want > IMPAIR_HDR_MAX)
		want = IMPAIR_HDR_MAX;
	if ((void *)(long)skb->data + want > (void *)(long)skb->data_end)
		bpf_skb_pull_data(skb, want);
}

/* The L2 walk of both tc programs: Ethernet and up to two tags, 802.1Q or
 * 802.1ad.  Wider than MetaRoCE's rule (parse_ethhdr): a tap acts on what
 * the wire carries, including frames the endpoint refuses. */
static __always_inline int impair_parse_eth(struct hdr_cursor *nh, void *data_end,
					    struct ethhdr **eth)
{
	int tags;

	return parse_ethhdr_tags(nh, data_end, eth, MR_VLAN_MAX_DEPTH, 1, &tags);
}

/* ECN CE on an ECT frame whose IP header starts at l3_off.  Returns 0 when
 * marked, 1 when the frame is Not-ECT or already CE (a switch marks only
 * ECN-capable packets), -1 on a helper failure.  The first 16-bit word of the
 * IP header holds the ECN bits: the IPv4 TOS is its low byte, the IPv6 Traffic
 * Class straddles it.  The IPv4 header checksum is fixed. */
static __always_inline int impair_mark_ce(struct __sk_buff *skb, __u32 l3_off, int ipv6)
{
	__u16 oldw, neww, h, ecn;

	if (bpf_skb_load_bytes(skb, l3_off, &oldw, 2) < 0)
		return -1;
	h = bpf_ntohs(oldw);
	ecn = ipv6 ? 0x0030 : 0x0003;
	if ((h & ecn) == 0 || (h & ecn) == ecn)
		return 1;
	neww = bpf_htons(h | ecn);
	if (bpf_skb_store_bytes(skb, l3_off, &neww, 2, 0) < 0)
		return -1;
	if (!ipv6 &&
	    bpf_l3_csum_replace(skb, l3_off + offsetof(struct iphdr, check), oldw, neww, 2) < 0)
		return -1;
	return 0;
}

#endif /* __TC_IMPAIR_COMMON_H */
