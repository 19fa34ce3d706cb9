/* xsk_redirect_test.c - TEST FIXTURE, not the MetaRoCE XDP program.
 *
 * Steers UDP frames to XSK_TEST_UDP_PORT (default 4791, RoCEv2) into the AF_XDP socket
 * registered for the frame's RX queue in xsks_map; every other frame goes to the kernel
 * stack untouched.  Used only by tests/afxdp/test_afxdp_netns.py to exercise
 * metaroce_xdp/afxdp.  The real program lives elsewhere in bpf/.
 *
 * Loaded through BCC:  BPF(src_file="bpf/xsk_redirect_test.c",
 *                          cflags=["-DXSK_TEST_UDP_PORT=4791", "-DXSK_TEST_MAX_QUEUES=64"])
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/udp.h>

#ifndef XSK_TEST_UDP_PORT
#define XSK_TEST_UDP_PORT 4791
#endif
#ifndef XSK_TEST_MAX_QUEUES
#define XSK_TEST_MAX_QUEUES 64
#endif

/* Why each frame got its verdict; index into verdicts.  Never renumber. */
enum xsk_test_reason {
	XSK_TEST_REDIRECTED  = 0, /* UDP to the port: handed to xsks_map[rx_queue_index] */
	XSK_TEST_NOT_IP_UDP  = 1, /* not IPv4/IPv6 + UDP: passed */
	XSK_TEST_OTHER_PORT  = 2, /* UDP to another port: passed */
	XSK_TEST_TRUNCATED   = 3, /* headers cut short: passed, the stack will judge */
	XSK_TEST_NO_SOCKET   = 4, /* port matched, no socket on this queue: passed */
	XSK_TEST__MAX,
};

/* AF_XDP socket per RX queue; written by the test (xskmap_set), read here. */
BPF_XSKMAP(xsks_map, XSK_TEST_MAX_QUEUES);
/* Frame count per enum xsk_test_reason; written here, read by the test. */
BPF_PERCPU_ARRAY(verdicts, u64, XSK_TEST__MAX);

/* parse_<hdr>(cursor, data_end, &hdr): bounds-check, advance, return the next protocol
 * or -1 when the header does not fit. */
static __always_inline int parse_ethhdr(void **cursor, void *data_end, struct ethhdr **eth)
{
	struct ethhdr *h = *cursor;

	if ((void *)(h + 1) > data_end)
		return -1;
	*eth = h;
	*cursor = h + 1;
	return h->h_proto; /* network byte order */
}

static __always_inline int parse_iphdr(void **cursor, void *data_end, struct iphdr **iph)
{
	struct iphdr *h = *cursor;
	int hlen;

	if ((void *)(h + 1) > data_end)
		return -1;
	hlen = h->ihl * 4;
	if (hlen < (int)sizeof(*h))
		return -1;
	/* variable-length header: check the full length, not just the fixed part */
	if (*cursor + hlen > data_end)
		return -1;
	*iph = h;
	*cursor += hlen;
	return h->protocol;
}

static __always_inline int parse_ipv6hdr(void **cursor, void *data_end, struct ipv6hdr **ip6h)
{
	struct ipv6hdr *h = *cursor;

	if ((void *)(h + 1) > data_end)
		return -1;
	*ip6h = h;
	*cursor = h + 1;
	return h->nexthdr; /* extension headers are not followed: RoCEv2 sends none */
}

static __always_inline int parse_udphdr(void **cursor, void *data_end, struct udphdr **udph)
{
	struct udphdr *h = *cursor;

	if ((void *)(h + 1) > data_end)
		return -1;
	*udph = h;
	*cursor = h + 1;
	return bpf_ntohs(h->dest);
}

int xsk_redirect_test(struct xdp_md *ctx)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *cursor = (void *)(long)ctx->data;
	struct ethhdr *eth;
	struct iphdr *iph;
	struct ipv6hdr *ip6h;
	struct udphdr *udph;
	u32 reason = XSK_TEST_NOT_IP_UDP;
	int action = XDP_PASS;
	int proto, dport;
	u64 *cnt;

	proto = parse_ethhdr(&cursor, data_end, &eth);
	if (proto == bpf_htons(ETH_P_IP))
		proto = parse_iphdr(&cursor, data_end, &iph);
	else if (proto == bpf_htons(ETH_P_IPV6))
		proto = parse_ipv6hdr(&cursor, data_end, &ip6h);
	else
		goto out;
	if (proto < 0) {
		reason = XSK_TEST_TRUNCATED;
		goto out;
	}
	if (proto != IPPROTO_UDP)
		goto out;

	dport = parse_udphdr(&cursor, data_end, &udph);
	if (dport < 0) {
		reason = XSK_TEST_TRUNCATED;
		goto out;
	}
	if (dport != XSK_TEST_UDP_PORT) {
		reason = XSK_TEST_OTHER_PORT;
		goto out;
	}
	/* The low bits of flags are the action when the map slot is empty (kernel >= 5.3):
	 * with no socket bound on this queue the frame goes to the stack instead of dropping. */
	action = xsks_map.redirect_map(ctx->rx_queue_index, XDP_PASS);
	reason = action == XDP_REDIRECT ? XSK_TEST_REDIRECTED : XSK_TEST_NO_SOCKET;
out:
	cnt = verdicts.lookup(&reason);
	if (cnt)
		*cnt += 1;
	return action;
}
