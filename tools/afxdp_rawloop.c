/* afxdp_rawloop.c - the substrate's limit: frames through one AF_XDP socket, nothing else.
 *
 * Role: the "raw AF_XDP" baseline of tools/bench.py.  It moves pre-built RoCEv2-sized
 * UDP/4791 frames (Eth + IPv4 + UDP + BTH + payload + ICRC) through an AF_XDP socket as
 * fast as the kernel lets it, with no protocol work, so MetaRoCE's own numbers can be read
 * as a fraction of what the substrate can carry at the same frame size.  Neighbours:
 * tools/bench.py builds this with gcc and drives both modes in two namespaces;
 * bpf/xsk_redirect_test.c is the XDP program that steers frames into the rx socket;
 * tests/tools/test_bench_smoke.py checks the measurement works.
 *
 * Only the kernel UAPI (<linux/if_xdp.h>, <linux/bpf.h>) and plain syscalls: no libxdp,
 * no libbpf.
 *
 *   afxdp_rawloop tx -i IFACE -s FRAME_BYTES -t SECONDS --src-mac M --dst-mac M
 *                    --src-ip A --dst-ip A [-q QUEUE] [-b BATCH] [-c CPU] [--budget N]
 *                    [--no-need-wakeup]
 *   afxdp_rawloop rx -i IFACE -t SECONDS (--xskmap-fd FD | --xskmap-pin PATH)
 *                    [-q QUEUE] [-s MAX_FRAME_BYTES] [-b BATCH] [-c CPU] [--idle SECONDS]
 *                    [--wait poll|spin|busy-poll] [--spin-us US] [--busy-poll-us US]
 *                    [--no-need-wakeup]
 *
 * The knobs are what tools/bench.py sweeps to find the fastest loop this machine allows:
 *   -b BATCH           descriptors handled per ring operation (tx: per submit; rx: per peek)
 *   --no-need-wakeup   bind without XDP_USE_NEED_WAKEUP: tx then kicks with sendto() on
 *                      every round that has frames queued, not only when the kernel asks
 *   --wait (rx, when its ring is empty)
 *        poll       spin --spin-us, then sleep in poll() until frames arrive (default)
 *        spin       never sleep: re-read the ring's producer until frames arrive
 *        busy-poll  SO_PREFER_BUSY_POLL + SO_BUSY_POLL(--busy-poll-us, default 50) +
 *                   SO_BUSY_POLL_BUDGET(BATCH), and recvfrom(MSG_DONTWAIT) to run the
 *                   device's NAPI from this thread
 *
 * A frame larger than a UMEM chunk (4096 B; e.g. 4154 B at path MTU 4096) is sent and
 * received as several descriptors with XDP_USE_SG (Linux >= 6.6; the XDP program on the
 * receiving side must then be frags-aware); frames count whole frames, descs the parts.
 *
 * tx sends for SECONDS and reports what the kernel completed.  rx inserts its socket into
 * the XSKMAP (an inherited map fd, or a pinned map opened with BPF_OBJ_GET), prints
 * "ready" on stdout, then counts frames for SECONDS from the first one received (or
 * gives up after --idle seconds without any).  Both end with one JSON line on stdout:
 *   {"mode", "frames", "bytes", "seconds", "fps", "gbps", ...counters}
 * gbps counts whole Ethernet frames (no preamble/FCS/IFG); cpu_s is the process's user +
 * system CPU time over its whole run (getrusage), for bytes-per-CPU-second comparisons.  Exit status 0 on success,
 * 1 on a set-up error (message on stderr naming the step), 2 on bad arguments.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <linux/bpf.h>
#include <linux/if_xdp.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef AF_XDP
#define AF_XDP 44
#endif
#ifndef SOL_XDP
#define SOL_XDP 283
#endif
/* Kernel >= 6.17: how many skbs one copy-mode sendto() may build (default 32).  Newer
 * than the installed UAPI header; setting it on an older kernel fails harmlessly. */
#ifndef XDP_MAX_TX_SKB_BUDGET
#define XDP_MAX_TX_SKB_BUDGET 9
#endif
/* Linux 6.6: multi-buffer AF_XDP.  A frame larger than a UMEM chunk spans several
 * descriptors; all but the last carry XDP_PKT_CONTD in their options. */
#ifndef XDP_USE_SG
#define XDP_USE_SG (1 << 4)
#endif
#ifndef XDP_PKT_CONTD
#define XDP_PKT_CONTD (1 << 0)
#endif

#define ROCE_UDP_PORT   4791
#define ETH_HLEN_       14
#define IPV4_HLEN       20
#define UDP_HLEN        8
#define BTH_LEN         12
#define ICRC_LEN        4
#define MIN_FRAME       (ETH_HLEN_ + IPV4_HLEN + UDP_HLEN + BTH_LEN + ICRC_LEN)
#define MAX_CHUNK       4096 /* aligned UMEM chunks: power of two, <= PAGE_SIZE */
#define MAX_FRAME       (4 * MAX_CHUNK) /* larger than a chunk: XDP_USE_SG, several descriptors */
#define RING_SIZE       4096 /* every ring; power of two */
#define NUM_FRAMES      8192 /* UMEM frames: RX keeps RING_SIZE of them on the fill ring */
/* Default: rx sleeps in poll() as soon as its ring is empty.  Spinning measured no better
 * on a 2-core VM and worse with threaded NAPI, whose kthread then shares rx's core. */
#define RX_SPIN_US      0
#define BTH_OP_WRITE_MIDDLE 0x07
#ifndef SO_PREFER_BUSY_POLL
#define SO_PREFER_BUSY_POLL 69
#endif
#ifndef SO_BUSY_POLL_BUDGET
#define SO_BUSY_POLL_BUDGET 70
#endif

enum wait_mode { WAIT_POLL, WAIT_SPIN, WAIT_BUSY_POLL };

/* ------------------------------------------------------------------ rings */

/* One mmapped ring: producer/consumer words shared with the kernel, plus cached copies so
 * the shared words are touched once per batch, not once per descriptor. */
struct ring {
	uint32_t *producer;
	uint32_t *consumer;
	uint32_t *flags;
	void *descs;
	uint32_t mask;
	uint32_t size;
	uint32_t cached_prod;
	uint32_t cached_cons;
	void *map;
	size_t map_len;
};

static inline uint32_t load_acquire(uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void store_release(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* Entries a consumer ring (rx, completion) holds, up to want. */
static inline uint32_t cons_peek(struct ring *r, uint32_t want)
{
	uint32_t n = r->cached_prod - r->cached_cons;

	if (n == 0) {
		r->cached_prod = load_acquire(r->producer);
		n = r->cached_prod - r->cached_cons;
	}
	return n < want ? n : want;
}

static inline void cons_release(struct ring *r, uint32_t n)
{
	r->cached_cons += n;
	store_release(r->consumer, r->cached_cons);
}

/* Free slots in a producer ring (tx, fill), up to want. */
static inline uint32_t prod_free(struct ring *r, uint32_t want)
{
	uint32_t n = r->size - (r->cached_prod - r->cached_cons);

	if (n < want) {
		r->cached_cons = load_acquire(r->consumer);
		n = r->size - (r->cached_prod - r->cached_cons);
	}
	return n < want ? n : want;
}

static inline void prod_submit(struct ring *r, uint32_t n)
{
	r->cached_prod += n;
	store_release(r->producer, r->cached_prod);
}

static inline int needs_wakeup(struct ring *r)
{
	return __atomic_load_n(r->flags, __ATOMIC_RELAXED) & XDP_RING_NEED_WAKEUP;
}

/* ------------------------------------------------------------------ helpers */

static volatile sig_atomic_t stop_flag;
static void on_signal(int sig) { (void)sig; stop_flag = 1; }

/* User + system CPU seconds this process has used so far. */
static double cpu_s(void)
{
	struct rusage ru;

	getrusage(RUSAGE_SELF, &ru);
	return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *step, const char *hint)
{
	int e = errno;

	fprintf(stderr, "afxdp_rawloop: %s failed: %s%s%s\n", step, strerror(e),
		hint ? " -- " : "", hint ? hint : "");
	exit(1);
}

static void usage(const char *why)
{
	fprintf(stderr, "afxdp_rawloop: %s\n"
		"usage: afxdp_rawloop tx -i IFACE -s FRAME -t SECS --src-mac M --dst-mac M "
		"--src-ip A --dst-ip A [-q Q] [-b BATCH] [-c CPU] [--budget N] [--no-need-wakeup]\n"
		"       afxdp_rawloop rx -i IFACE -t SECS (--xskmap-fd FD | --xskmap-pin PATH) "
		"[-q Q] [-s MAXFRAME] [-b BATCH] [-c CPU] [--idle SECS] [--wait poll|spin|busy-poll] "
		"[--spin-us US] [--busy-poll-us US] [--no-need-wakeup]\n", why);
	exit(2);
}

static long sys_bpf(int cmd, union bpf_attr *attr)
{
	return syscall(__NR_bpf, cmd, attr, sizeof(*attr));
}

static void pin_cpu(int cpu)
{
	cpu_set_t set;

	if (cpu < 0)
		return;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	if (sched_setaffinity(0, sizeof(set), &set) != 0)
		die("sched_setaffinity", "is the CPU online?");
}

static int parse_mac(const char *s, uint8_t mac[6])
{
	unsigned int b[6];

	if (sscanf(s, "%x:%x:%x:%x:%x:%x", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5]) != 6)
		return -1;
	for (int i = 0; i < 6; i++)
		mac[i] = (uint8_t)b[i];
	return 0;
}

static uint16_t ip_csum(const void *data, size_t len)
{
	const uint16_t *p = data;
	uint32_t sum = 0;

	for (; len > 1; len -= 2)
		sum += *p++;
	while (sum >> 16)
		sum = (sum & 0xffff) + (sum >> 16);
	return (uint16_t)~sum;
}

/* ------------------------------------------------------------------ socket set-up */

struct xsk {
	int fd;
	uint8_t *umem;
	size_t umem_len;
	uint32_t chunk;
	struct ring rx, tx, fill, comp;
};

static void map_ring(int fd, struct ring *r, struct xdp_ring_offset *off, uint32_t size,
		     size_t desc_size, off_t pgoff, const char *name)
{
	r->map_len = off->desc + (size_t)size * desc_size;
	r->map = mmap(NULL, r->map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, pgoff);
	if (r->map == MAP_FAILED)
		die(name, "mmap of the ring");
	r->producer = (uint32_t *)((uint8_t *)r->map + off->producer);
	r->consumer = (uint32_t *)((uint8_t *)r->map + off->consumer);
	r->flags = (uint32_t *)((uint8_t *)r->map + off->flags);
	r->descs = (uint8_t *)r->map + off->desc;
	r->size = size;
	r->mask = size - 1;
	r->cached_prod = *r->producer;
	r->cached_cons = *r->consumer;
}

/* One socket on (ifname, queue) in copy mode, with need_wakeup unless told not; rings
 * only for the directions asked for (fill and completion always: bind insists on both). */
static void xsk_open(struct xsk *x, const char *ifname, int queue, uint32_t chunk, int want_rx, int want_tx,
		     int need_wakeup, int sg)
{
	struct xdp_umem_reg reg = {0};
	struct xdp_mmap_offsets off;
	struct sockaddr_xdp sxdp = {0};
	socklen_t optlen = sizeof(off);
	uint32_t ring = RING_SIZE;
	unsigned int ifindex = if_nametoindex(ifname);

	if (!ifindex)
		die("if_nametoindex", "is the interface in this namespace?");
	x->chunk = chunk;
	x->fd = socket(AF_XDP, SOCK_RAW | SOCK_CLOEXEC, 0);
	if (x->fd < 0)
		die("socket(AF_XDP)", "needs CONFIG_XDP_SOCKETS and root");
	x->umem_len = (size_t)NUM_FRAMES * chunk;
	x->umem = mmap(NULL, x->umem_len, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	if (x->umem == MAP_FAILED)
		die("mmap(UMEM)", NULL);
	reg.addr = (uint64_t)(uintptr_t)x->umem;
	reg.len = x->umem_len;
	reg.chunk_size = chunk;
	reg.headroom = 0;
	if (setsockopt(x->fd, SOL_XDP, XDP_UMEM_REG, &reg, sizeof(reg)))
		die("XDP_UMEM_REG", "chunk must be a power of two in [2048, 4096]; RLIMIT_MEMLOCK");
	if (setsockopt(x->fd, SOL_XDP, XDP_UMEM_FILL_RING, &ring, sizeof(ring)) ||
	    setsockopt(x->fd, SOL_XDP, XDP_UMEM_COMPLETION_RING, &ring, sizeof(ring)))
		die("XDP_UMEM_FILL_RING/COMPLETION_RING", NULL);
	if (want_rx && setsockopt(x->fd, SOL_XDP, XDP_RX_RING, &ring, sizeof(ring)))
		die("XDP_RX_RING", NULL);
	if (want_tx && setsockopt(x->fd, SOL_XDP, XDP_TX_RING, &ring, sizeof(ring)))
		die("XDP_TX_RING", NULL);
	if (getsockopt(x->fd, SOL_XDP, XDP_MMAP_OFFSETS, &off, &optlen))
		die("XDP_MMAP_OFFSETS", NULL);
	map_ring(x->fd, &x->fill, &off.fr, ring, sizeof(uint64_t), XDP_UMEM_PGOFF_FILL_RING, "fill ring");
	map_ring(x->fd, &x->comp, &off.cr, ring, sizeof(uint64_t), XDP_UMEM_PGOFF_COMPLETION_RING,
		 "completion ring");
	if (want_rx)
		map_ring(x->fd, &x->rx, &off.rx, ring, sizeof(struct xdp_desc), XDP_PGOFF_RX_RING, "rx ring");
	if (want_tx)
		map_ring(x->fd, &x->tx, &off.tx, ring, sizeof(struct xdp_desc), XDP_PGOFF_TX_RING, "tx ring");

	sxdp.sxdp_family = AF_XDP;
	sxdp.sxdp_ifindex = ifindex;
	sxdp.sxdp_queue_id = queue;
	sxdp.sxdp_flags = XDP_COPY | (need_wakeup ? XDP_USE_NEED_WAKEUP : 0) | (sg ? XDP_USE_SG : 0);
	/* A socket closed just before (the previous run) releases its queue from a
	 * workqueue, a little later: EBUSY for a while is expected, not an error. */
	for (int tries = 0; bind(x->fd, (struct sockaddr *)&sxdp, sizeof(sxdp)); tries++) {
		if (errno != EBUSY || tries >= 300)
			die("bind", sg ? "XDP_USE_SG needs Linux >= 6.6; queue exists? another socket bound to it?"
				       : "queue exists? another socket still bound to it?");
		usleep(10000);
	}
}

static void xsk_stats(struct xsk *x, struct xdp_statistics *st)
{
	socklen_t len = sizeof(*st);

	memset(st, 0, sizeof(*st));
	getsockopt(x->fd, SOL_XDP, XDP_STATISTICS, st, &len); /* best effort: counters only */
}

static uint32_t chunk_for(uint32_t frame)
{
	return frame <= 2048 ? 2048 : 4096;
}

/* ------------------------------------------------------------------ tx */

struct opts {
	const char *ifname;
	int queue;
	uint32_t frame;
	double seconds;
	double idle;
	double spin_us;
	uint32_t batch;
	int cpu;
	int budget;
	int need_wakeup;
	enum wait_mode wait;
	int busy_poll_us;
	int map_fd;
	const char *map_pin;
	uint8_t src_mac[6], dst_mac[6];
	struct in_addr src_ip, dst_ip;
	int have_src_mac, have_dst_mac, have_src_ip, have_dst_ip;
};

/* Eth + IPv4 + UDP/4791 + BTH (RDMA WRITE Middle) + zero payload + ICRC placeholder: the
 * shape and size of a MetaRoCE data packet.  The ICRC is not computed: nobody checks it. */
static void build_frame(uint8_t *f, const struct opts *o)
{
	uint32_t ip_len = o->frame - ETH_HLEN_;
	uint8_t *ip = f + ETH_HLEN_, *udp = ip + IPV4_HLEN, *bth = udp + UDP_HLEN;

	memset(f, 0, o->frame);
	memcpy(f, o->dst_mac, 6);
	memcpy(f + 6, o->src_mac, 6);
	f[12] = 0x08; f[13] = 0x00;
	ip[0] = 0x45;
	*(uint16_t *)(ip + 2) = htons(ip_len);
	*(uint16_t *)(ip + 6) = htons(0x4000); /* DF, as RoCEv2 requires */
	ip[8] = 64;
	ip[9] = IPPROTO_UDP;
	memcpy(ip + 12, &o->src_ip, 4);
	memcpy(ip + 16, &o->dst_ip, 4);
	*(uint16_t *)(ip + 10) = ip_csum(ip, IPV4_HLEN);
	*(uint16_t *)(udp + 0) = htons(49152);
	*(uint16_t *)(udp + 2) = htons(ROCE_UDP_PORT);
	*(uint16_t *)(udp + 4) = htons(ip_len - IPV4_HLEN);
	bth[0] = BTH_OP_WRITE_MIDDLE;
	bth[1] = 0x40; /* MigReq */
	*(uint16_t *)(bth + 2) = htons(0xffff); /* P_Key */
	bth[7] = 0x11; /* DestQP 0x000011 */
}

static int run_tx(struct opts *o)
{
	struct xsk x;
	struct xdp_statistics st;
	uint64_t free_addrs[NUM_FRAMES];
	uint32_t nfree = 0;
	uint64_t sent = 0, completed = 0, kicks = 0, kick_errors = 0;
	double t0, t_end, t_last;

	if (!o->have_src_mac || !o->have_dst_mac || !o->have_src_ip || !o->have_dst_ip)
		usage("tx needs --src-mac, --dst-mac, --src-ip and --dst-ip");
	if (o->frame < MIN_FRAME || o->frame > MAX_FRAME)
		usage("frame size out of range");
	xsk_open(&x, o->ifname, o->queue, chunk_for(o->frame), 0, 1, o->need_wakeup, o->frame > MAX_CHUNK);
	if (o->budget > 0) /* best effort: the option is newer than most kernels */
		setsockopt(x.fd, SOL_XDP, XDP_MAX_TX_SKB_BUDGET, &o->budget, sizeof(o->budget));
	/* A frame occupies `parts` consecutive chunks (a slot); only slot bases go on the free
	 * list, and a slot is free again when its first descriptor completes. */
	uint32_t parts = (o->frame + x.chunk - 1) / x.chunk;
	uint64_t slot = (uint64_t)parts * x.chunk;

	for (uint32_t i = 0; i < NUM_FRAMES / parts; i++) {
		build_frame(x.umem + i * slot, o);
		free_addrs[nfree++] = i * slot;
	}

	t0 = now_s();
	t_end = t0 + o->seconds;
	t_last = t0;
	for (uint64_t iter = 0; !stop_flag; iter++) {
		/* reap first: completed frames are what the next batch reuses */
		uint32_t n = cons_peek(&x.comp, RING_SIZE);

		if (n) {
			uint64_t *ca = x.comp.descs;

			for (uint32_t i = 0; i < n; i++) {
				uint64_t a = ca[(x.comp.cached_cons + i) & x.comp.mask];

				if (a % slot == 0) {
					free_addrs[nfree++] = a;
					completed++;
				}
			}
			cons_release(&x.comp, n);
		}
		n = prod_free(&x.tx, (o->batch < nfree ? o->batch : nfree) * parts) / parts;
		if (n) {
			struct xdp_desc *d = x.tx.descs;
			uint32_t k = 0;

			for (uint32_t i = 0; i < n; i++) {
				uint64_t base = free_addrs[--nfree];

				for (uint32_t p = 0; p < parts; p++, k++) {
					struct xdp_desc *e = &d[(x.tx.cached_prod + k) & x.tx.mask];
					uint32_t off = p * x.chunk;

					e->addr = base + off;
					e->len = p + 1 < parts ? x.chunk : o->frame - off;
					e->options = p + 1 < parts ? XDP_PKT_CONTD : 0;
				}
			}
			prod_submit(&x.tx, k);
			sent += n;
		}
		/* copy mode: the kernel transmits only inside sendto(), a bounded batch per call;
		 * without need_wakeup the flag is never set, so every round with frames kicks */
		if ((!o->need_wakeup || needs_wakeup(&x.tx)) && x.tx.cached_prod != load_acquire(x.tx.consumer)) {
			kicks++;
			if (sendto(x.fd, NULL, 0, MSG_DONTWAIT, NULL, 0) < 0 &&
			    errno != EAGAIN && errno != EBUSY && errno != ENOBUFS && errno != ENETDOWN)
				kick_errors++;
		}
		if ((iter & 63) == 0) {
			t_last = now_s();
			if (t_last >= t_end)
				break;
		}
	}
	t_last = now_s();
	xsk_stats(&x, &st);
	{
		double secs = t_last - t0;
		double fps = completed / secs;

		printf("{\"mode\": \"tx\", \"frames\": %llu, \"bytes\": %llu, \"seconds\": %.6f, "
		       "\"fps\": %.1f, \"gbps\": %.4f, \"frame_bytes\": %u, \"queued\": %llu, "
		       "\"kicks\": %llu, \"kick_errors\": %llu, \"tx_invalid_descs\": %llu, "
		       "\"tx_ring_empty_descs\": %llu, \"cpu_s\": %.4f}\n",
		       (unsigned long long)completed, (unsigned long long)completed * o->frame, secs, fps,
		       fps * o->frame * 8 / 1e9, o->frame, (unsigned long long)sent,
		       (unsigned long long)kicks, (unsigned long long)kick_errors,
		       (unsigned long long)st.tx_invalid_descs, (unsigned long long)st.tx_ring_empty_descs, cpu_s());
	}
	fflush(stdout);
	return 0;
}

/* ------------------------------------------------------------------ rx */

/* Put this socket into xsks_map[queue] so the XDP program's redirect reaches it. */
static void xskmap_insert(struct opts *o, int xsk_fd)
{
	union bpf_attr attr;
	uint32_t key = o->queue;
	int map_fd = o->map_fd;

	if (o->map_pin) {
		memset(&attr, 0, sizeof(attr));
		attr.pathname = (uint64_t)(uintptr_t)o->map_pin;
		map_fd = sys_bpf(BPF_OBJ_GET, &attr);
		if (map_fd < 0)
			die("BPF_OBJ_GET", "is the XSKMAP pinned at that path (bpffs)?");
	}
	memset(&attr, 0, sizeof(attr));
	attr.map_fd = map_fd;
	attr.key = (uint64_t)(uintptr_t)&key;
	attr.value = (uint64_t)(uintptr_t)&xsk_fd;
	attr.flags = BPF_ANY;
	if (sys_bpf(BPF_MAP_UPDATE_ELEM, &attr) < 0)
		die("BPF_MAP_UPDATE_ELEM(xsks_map)", "is the fd an XSKMAP with a slot for this queue?");
}

static int run_rx(struct opts *o)
{
	struct xsk x;
	struct xdp_statistics st;
	uint64_t frames = 0, bytes = 0, polls = 0, busy_polls = 0, descs = 0;
	double t_start, t_first = 0, t_end = 0, t_last = 0, t_empty = 0;
	struct pollfd pfd;

	if (o->map_fd < 0 && !o->map_pin)
		usage("rx needs --xskmap-fd or --xskmap-pin");
	xsk_open(&x, o->ifname, o->queue, chunk_for(o->frame), 1, 0, o->need_wakeup, o->frame > MAX_CHUNK);
	if (o->wait == WAIT_BUSY_POLL) {
		int one = 1, budget = (int)o->batch;

		if (setsockopt(x.fd, SOL_SOCKET, SO_PREFER_BUSY_POLL, &one, sizeof(one)) ||
		    setsockopt(x.fd, SOL_SOCKET, SO_BUSY_POLL, &o->busy_poll_us, sizeof(o->busy_poll_us)) ||
		    setsockopt(x.fd, SOL_SOCKET, SO_BUSY_POLL_BUDGET, &budget, sizeof(budget)))
			die("SO_PREFER_BUSY_POLL/SO_BUSY_POLL/SO_BUSY_POLL_BUDGET", "kernel >= 5.11 and CAP_NET_ADMIN");
	}
	{
		uint64_t *fa = x.fill.descs;
		uint32_t n = prod_free(&x.fill, RING_SIZE);

		for (uint32_t i = 0; i < n; i++)
			fa[(x.fill.cached_prod + i) & x.fill.mask] = (uint64_t)i * x.chunk;
		prod_submit(&x.fill, n);
	}
	xskmap_insert(o, x.fd);
	printf("ready\n");
	fflush(stdout);

	pfd.fd = x.fd;
	pfd.events = POLLIN;
	t_start = now_s();
	while (!stop_flag) {
		uint32_t n = cons_peek(&x.rx, o->batch);

		if (n == 0) {
			t_last = now_s();
			if (descs ? t_last >= t_end : t_last - t_start >= o->idle)
				break;
			if (o->wait == WAIT_SPIN)
				continue;
			if (o->wait == WAIT_BUSY_POLL) {
				/* runs the device's NAPI here for up to --busy-poll-us */
				busy_polls++;
				recvfrom(x.fd, NULL, 0, MSG_DONTWAIT, NULL, NULL);
				continue;
			}
			/* --spin-us: spin that long before sleeping (trades a core for wakeups) */
			if (t_empty == 0)
				t_empty = t_last;
			if ((t_last - t_empty) * 1e6 < o->spin_us)
				continue;
			polls++;
			poll(&pfd, 1, 10);
			continue;
		}
		t_empty = 0;
		if (!descs) {
			t_first = now_s();
			t_end = t_first + o->seconds;
		}
		{
			struct xdp_desc *d = x.rx.descs;
			uint64_t *fa = x.fill.descs;
			uint32_t room = prod_free(&x.fill, n); /* == n: fill ring holds every frame */

			for (uint32_t i = 0; i < room; i++) {
				struct xdp_desc *e = &d[(x.rx.cached_cons + i) & x.rx.mask];

				bytes += e->len;
				frames += !(e->options & XDP_PKT_CONTD); /* a frame ends at its last part */
				fa[(x.fill.cached_prod + i) & x.fill.mask] = e->addr;
			}
			cons_release(&x.rx, room);
			prod_submit(&x.fill, room);
			descs += room;
		}
		if (now_s() >= t_end) /* vDSO clock: cheap next to a 64-frame batch */
			break;
	}
	t_last = now_s();
	xsk_stats(&x, &st);
	{
		double secs = descs ? t_last - t_first : 0.0;
		double fps = secs > 0 ? frames / secs : 0.0;
		double gbps = secs > 0 ? bytes * 8 / secs / 1e9 : 0.0;

		printf("{\"mode\": \"rx\", \"frames\": %llu, \"bytes\": %llu, \"seconds\": %.6f, "
		       "\"fps\": %.1f, \"gbps\": %.4f, \"polls\": %llu, \"rx_dropped\": %llu, "
		       "\"rx_invalid_descs\": %llu, \"rx_ring_full\": %llu, "
		       "\"rx_fill_ring_empty_descs\": %llu, \"busy_polls\": %llu, \"descs\": %llu, \"cpu_s\": %.4f}\n",
		       (unsigned long long)frames, (unsigned long long)bytes, secs, fps, gbps,
		       (unsigned long long)polls, (unsigned long long)st.rx_dropped,
		       (unsigned long long)st.rx_invalid_descs, (unsigned long long)st.rx_ring_full,
		       (unsigned long long)st.rx_fill_ring_empty_descs, (unsigned long long)busy_polls,
		       (unsigned long long)descs, cpu_s());
	}
	fflush(stdout);
	return 0;
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{"ifname", required_argument, NULL, 'i'},
		{"queue", required_argument, NULL, 'q'},
		{"size", required_argument, NULL, 's'},
		{"seconds", required_argument, NULL, 't'},
		{"batch", required_argument, NULL, 'b'},
		{"cpu", required_argument, NULL, 'c'},
		{"budget", required_argument, NULL, 'B'},
		{"idle", required_argument, NULL, 'I'},
		{"spin-us", required_argument, NULL, 'S'},
		{"xskmap-fd", required_argument, NULL, 'F'},
		{"xskmap-pin", required_argument, NULL, 'P'},
		{"no-need-wakeup", no_argument, NULL, 'N'},
		{"wait", required_argument, NULL, 'W'},
		{"busy-poll-us", required_argument, NULL, 'U'},
		{"src-mac", required_argument, NULL, 'm'},
		{"dst-mac", required_argument, NULL, 'M'},
		{"src-ip", required_argument, NULL, 'a'},
		{"dst-ip", required_argument, NULL, 'A'},
		{NULL, 0, NULL, 0},
	};
	struct opts o = {.queue = 0, .frame = 4096, .seconds = 2.0, .idle = 10.0, .spin_us = RX_SPIN_US, .batch = 64,
			 .cpu = -1, .budget = 0, .need_wakeup = 1, .wait = WAIT_POLL, .busy_poll_us = 50,
			 .map_fd = -1};
	const char *mode;
	int c;

	if (argc < 2)
		usage("missing mode (tx or rx)");
	mode = argv[1];
	optind = 2;
	while ((c = getopt_long(argc, argv, "i:q:s:t:b:c:", longopts, NULL)) != -1) {
		switch (c) {
		case 'i': o.ifname = optarg; break;
		case 'q': o.queue = atoi(optarg); break;
		case 's': o.frame = (uint32_t)atoi(optarg); break;
		case 't': o.seconds = atof(optarg); break;
		case 'b': o.batch = (uint32_t)atoi(optarg); break;
		case 'c': o.cpu = atoi(optarg); break;
		case 'B': o.budget = atoi(optarg); break;
		case 'I': o.idle = atof(optarg); break;
		case 'S': o.spin_us = atof(optarg); break;
		case 'F': o.map_fd = atoi(optarg); break;
		case 'P': o.map_pin = optarg; break;
		case 'N': o.need_wakeup = 0; break;
		case 'W':
			if (!strcmp(optarg, "poll")) o.wait = WAIT_POLL;
			else if (!strcmp(optarg, "spin")) o.wait = WAIT_SPIN;
			else if (!strcmp(optarg, "busy-poll")) o.wait = WAIT_BUSY_POLL;
			else usage("--wait must be poll, spin or busy-poll");
			break;
		case 'U': o.busy_poll_us = atoi(optarg); break;
		case 'm': if (parse_mac(optarg, o.src_mac)) usage("bad --src-mac"); o.have_src_mac = 1; break;
		case 'M': if (parse_mac(optarg, o.dst_mac)) usage("bad --dst-mac"); o.have_dst_mac = 1; break;
		case 'a': if (inet_pton(AF_INET, optarg, &o.src_ip) != 1) usage("bad --src-ip"); o.have_src_ip = 1; break;
		case 'A': if (inet_pton(AF_INET, optarg, &o.dst_ip) != 1) usage("bad --dst-ip"); o.have_dst_ip = 1; break;
		default: usage("unknown option");
		}
	}
	if (!o.ifname)
		usage("missing -i IFACE");
	if (o.seconds <= 0 || o.batch == 0 || o.batch > RING_SIZE)
		usage("bad -t or -b");
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	pin_cpu(o.cpu);
	if (!strcmp(mode, "tx"))
		return run_tx(&o);
	if (!strcmp(mode, "rx"))
		return run_rx(&o);
	usage("mode must be tx or rx");
	return 2;
}
