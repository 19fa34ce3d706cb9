/* SPDX-License-Identifier: Apache-2.0 */
/*
 * parsing_helpers.h - bounds-checked header parsers (xdp-tutorial style).
 *
 * Each parse_<hdr>(cursor, data_end, &hdr) checks `hdr + 1 > data_end`,
 * advances the cursor past the header and returns the next header's type
 * (ethertype in network order, IP protocol, UDP destination port in host
 * order, BTH opcode).  On failure it returns a negative value, minus the
 * DecodeReason (enum mr_drop_reason) that says why, and leaves the cursor
 * where it was; *hdr is set whenever the fixed header was in bounds so the
 * caller can look closer (e.g. at an IPv4 header with options).
 *
 * Kernel only (uses kernel header structs); the caller decides the verdict.
 * Shared by the XDP program and the tc programs (fault_inject.c,
 * fabric_impair.c, through tc_impair_common.h), so one definition says how
 * the header stack is walked.  parse_ethhdr() and parse_iphdr() apply
 * MetaRoCE's own rules (one 802.1Q tag, no IPv4 options or fragments);
 * parse_ethhdr_tags() and parse_iphdr_any() walk what any switch forwards,
 * for the tc programs, which act on frames the endpoint would refuse.
 */
#ifndef __PARSING_HELPERS_H
#define __PARSING_HELPERS_H

#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/udp.h>
#include "metaroce_consts.h"
#include "metaroce_hdr.h"
#include "metaroce_drop_reasons.h"

struct hdr_cursor {
	void *pos;
};

/* 802.1Q / 802.1ad tag; not exported by uapi headers. */
struct mr_vlan_hdr {
	__be16 h_vlan_TCI;
	__be16 h_vlan_encapsulated_proto;
};

/* Only 802.1Q: a frame with an 802.1ad (0x88A8) tag is not MetaRoCE and
 * goes to the stack (MR-ENC-005), so its TPID is returned as the ethertype. */
static __always_inline int mr_proto_is_vlan(__u16 h_proto)
{
	return h_proto == mr_htons(MR_ETH_P_8021Q);
}

/* Most tags parse_ethhdr_tags() walks, the bound of its unrolled loop. */
#define MR_VLAN_MAX_DEPTH 2

/* Ethernet plus up to max_tags (at most MR_VLAN_MAX_DEPTH) VLAN tags: 802.1Q,
 * and 802.1ad as well when qinq is set.  Returns the ethertype after the
 * tags, network byte order, and the number of tags walked in *tags; a tag
 * beyond max_tags is not walked, its TPID is returned as the ethertype. */
static __always_inline int parse_ethhdr_tags(struct hdr_cursor *nh, void *data_end,
					     struct ethhdr **ethhdr, int max_tags, int qinq,
					     int *tags)
{
	struct ethhdr *eth = nh->pos;
	struct mr_vlan_hdr *vh;
	__u16 h_proto;

	*tags = 0;
	if (eth + 1 > (struct ethhdr *)data_end)
		return -MR_DROP_TRUNCATED_ETH;
	*ethhdr = eth;
	h_proto = eth->h_proto;
	vh = (struct mr_vlan_hdr *)(eth + 1);
#pragma unroll
	for (int i = 0; i < MR_VLAN_MAX_DEPTH; i++) {
		if (i >= max_tags)
			break;
		if (!mr_proto_is_vlan(h_proto) &&
		    !(qinq && h_proto == mr_htons(MR_ETH_P_8021AD)))
			break;
		if (vh + 1 > (struct mr_vlan_hdr *)data_end)
			return -MR_DROP_TRUNCATED_ETH;
		h_proto = vh->h_vlan_encapsulated_proto;
		*tags += 1;
		vh++;
	}
	nh->pos = vh;
	return h_proto;
}

/* Ethernet plus at most one 802.1Q tag (MR-ENC-005 allows one).  Returns the
 * ethertype after the tag, network byte order; *vlan is 1 if a tag was seen.
 * A second tag is simply "not IP" and is passed. */
static __always_inline int parse_ethhdr(struct hdr_cursor *nh, void *data_end,
					struct ethhdr **ethhdr, int *vlan)
{
	return parse_ethhdr_tags(nh, data_end, ethhdr, 1, 0, vlan);
}

/* IPv4 without options or fragmentation (MR-ENC-008 to MR-ENC-010).  Returns
 * the protocol. */
static __always_inline int parse_iphdr(struct hdr_cursor *nh, void *data_end,
				       struct iphdr **iphdr)
{
	struct iphdr *iph = nh->pos;

	if (iph + 1 > (struct iphdr *)data_end)
		return -MR_DROP_TRUNCATED_IP;
	*iphdr = iph;
	if (iph->version != 4 || iph->ihl < 5)
		return -MR_DROP_BAD_IP_HEADER;
	if (iph->ihl != 5)
		return -MR_DROP_IP_OPTIONS;
	/* MF set or a non-zero offset: 0x3FFF masks both, leaves DF alone. */
	if (iph->frag_off & mr_htons(0x3FFF))
		return -MR_DROP_IP_FRAGMENT;
	nh->pos = iph + 1;
	return iph->protocol;
}

/* Any IPv4 header, as a router reads it: options are skipped, not refused,
 * and a first fragment (MF set, offset 0) carries its L4 header.  Returns the
 * protocol with the cursor past the options; -MR_DROP_IP_FRAGMENT for a
 * later fragment, which has no L4 header, and -MR_DROP_TRUNCATED_IP when the
 * options run past data_end, both with *iphdr set. */
static __always_inline int parse_iphdr_any(struct hdr_cursor *nh, void *data_end,
					   struct iphdr **iphdr)
{
	struct iphdr *iph = nh->pos;
	void *l4;

	if (iph + 1 > (struct iphdr *)data_end)
		return -MR_DROP_TRUNCATED_IP;
	*iphdr = iph;
	if (iph->version != 4 || iph->ihl < 5)
		return -MR_DROP_BAD_IP_HEADER;
	if (iph->frag_off & mr_htons(0x1FFF))
		return -MR_DROP_IP_FRAGMENT;
	/* ihl is 4 bits: the verifier sees a bounded offset. */
	l4 = (void *)iph + (iph->ihl & 0xF) * 4;
	if (l4 > data_end)
		return -MR_DROP_TRUNCATED_IP;
	nh->pos = l4;
	return iph->protocol;
}

/* IPv6 fixed header; extension headers are not followed (MetaRoCE puts UDP
 * right after it), so their presence shows as "not UDP".  Returns nexthdr. */
static __always_inline int parse_ip6hdr(struct hdr_cursor *nh, void *data_end,
					struct ipv6hdr **ip6hdr)
{
	struct ipv6hdr *ip6h = nh->pos;

	if (ip6h + 1 > (struct ipv6hdr *)data_end)
		return -MR_DROP_TRUNCATED_IP;
	*ip6hdr = ip6h;
	if (ip6h->version != 6)
		return -MR_DROP_BAD_IP_HEADER;
	nh->pos = ip6h + 1;
	return ip6h->nexthdr;
}

/* UDP header.  Returns the destination port, host order. */
static __always_inline int parse_udphdr(struct hdr_cursor *nh, void *data_end,
					struct udphdr **udphdr)
{
	struct udphdr *h = nh->pos;

	if (h + 1 > (struct udphdr *)data_end)
		return -MR_DROP_TRUNCATED_UDP;
	*udphdr = h;
	nh->pos = h + 1;
	return mr_ntohs(h->dest);
}

/* Base Transport Header, TVer 0 only (MR-BTH-007).  Returns the opcode. */
static __always_inline int parse_bth(struct hdr_cursor *nh, void *data_end,
				     struct mr_bth **bthdr)
{
	struct mr_bth *b = nh->pos;

	if (b + 1 > (struct mr_bth *)data_end)
		return -MR_DROP_TRUNCATED_BTH;
	*bthdr = b;
	if (mr_bth_tver(b) != 0)
		return -MR_DROP_BAD_TVER;
	nh->pos = b + 1;
	return b->opcode;
}

#endif /* __PARSING_HELPERS_H */
