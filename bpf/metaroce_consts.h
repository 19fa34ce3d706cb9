/* SPDX-License-Identifier: Apache-2.0 */
/*
 * metaroce_consts.h - every tunable of the MetaRoCE XDP program.
 *
 * Each value can be overridden at load time with a -D flag (the loader in
 * metaroce_xdp/kern/loader.py passes them; never edit program text).  Values
 * that are also needed by user space are mirrored in metaroce_xdp/kern/layout.py
 * and compared by tests/kern/test_c_python_agree.py.
 *
 * No kernel-only includes: this header is also compiled by gcc in the tests.
 */
#ifndef __METAROCE_CONSTS_H
#define __METAROCE_CONSTS_H

/* Number of QP slots in mr_qps.  A QP lives in slot (qpn % MR_MAX_QPS); the
 * daemon allocates QPNs so that live QPs never collide.  Must be a power of
 * two so the modulo is a mask and the mmap size is a whole number of pages. */
#ifndef MR_MAX_QPS
#define MR_MAX_QPS 1024
#endif

/* RoCEv2 / MetaRoCE UDP destination port (IANA 4791, MR-ENC-019). */
#ifndef ROCE_UDP_PORT
#define ROCE_UDP_PORT 4791
#endif

/* Entries in mr_xsks: one AF_XDP socket per RX queue. */
#ifndef MR_MAX_RXQ
#define MR_MAX_RXQ 64
#endif

/* Size of the per-CPU drop-reason and event counter arrays.  Reasons and
 * events are indices into them; keep these larger than the highest value in
 * metaroce_drop_reasons.h (a static assert checks). */
#ifndef MR_DROP_SLOTS
#define MR_DROP_SLOTS 64
#endif
#ifndef MR_EVENT_SLOTS
#define MR_EVENT_SLOTS 16
#endif

/* Verify the ICRC of ACKNOWLEDGE packets in the kernel before they move QP
 * state (1) or trust the wire (0).  See mr_ack_icrc_ok() in metaroce_xdp.c. */
#ifndef MR_VERIFY_ACK_ICRC
#define MR_VERIFY_ACK_ICRC 1
#endif

/* Smoothed RTT gains as right shifts (RFC 6298: alpha = 1/8, beta = 1/4). */
#ifndef MR_SRTT_SHIFT
#define MR_SRTT_SHIFT 3
#endif
#ifndef MR_RTTVAR_SHIFT
#define MR_RTTVAR_SHIFT 2
#endif

/* Protocol constants (not tunables, but one place for them). */
#define MR_PSN_MASK      0xFFFFFFu      /* PSN is 24 bits (MR-BTH-020) */
#define MR_PSN_HALF      0x800000u      /* serial-number half window */
#define MR_PSN_NONE      0xFFFFFFFFu    /* "no PSN" in a PSN field: equal to no 24-bit PSN */
#define MR_QPN_MASK      0xFFFFFFu
#define MR_ICRC_SIZE     4
#define MR_SACK_MAX_WORDS 32
#define MR_ETH_P_IP      0x0800
#define MR_ETH_P_IPV6    0x86DD
#define MR_ETH_P_8021Q   0x8100
#define MR_ETH_P_8021AD  0x88A8
#define MR_IPPROTO_UDP   17

#endif /* __METAROCE_CONSTS_H */
