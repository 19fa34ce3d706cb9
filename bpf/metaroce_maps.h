/* SPDX-License-Identifier: Apache-2.0 */
/*
 * metaroce_maps.h - the XDP program's maps: what each holds, who writes it.
 *
 * BCC map declarations (kernel side only).  The loader pins mr_qps, mr_cfg,
 * mr_drops and mr_events under /sys/fs/bpf/metaroce/<ifname>/ for the CLI.
 */
#ifndef __METAROCE_MAPS_H
#define __METAROCE_MAPS_H

#include "metaroce_consts.h"
#include "metaroce_structs.h"

/* Per-QP shared state, slot qpn % MR_MAX_QPS; mmapped by user space.
 * Writers: daemon (control part), requester, kernel ACK path (see structs). */
BPF_F_TABLE("array", u32, struct mr_qp_state, mr_qps, MR_MAX_QPS, BPF_F_MMAPABLE);

/* Endpoint identity (local IPs, MAC, flags), key 0; written by the daemon. */
BPF_ARRAY(mr_cfg, struct mr_config, 1);

/* Drop counters indexed by enum mr_drop_reason; written by the kernel. */
BPF_PERCPU_ARRAY(mr_drops, u64, MR_DROP_SLOTS);

/* Event counters indexed by enum mr_event; written by the kernel. */
BPF_PERCPU_ARRAY(mr_events, u64, MR_EVENT_SLOTS);

/* NATIVE_SACK rings, one per native QP that has one (mr_qp_state.sack_ring - 1);
 * mmapped by the data plane.  Protocol and writers: struct mr_sack_ring. */
BPF_F_TABLE("array", u32, struct mr_sack_ring, mr_sacks, MR_SACK_RINGS, BPF_F_MMAPABLE);

/* Per-CPU scratch: the ICRC input of a NATIVE_SACK, up to 208 bytes (too
 * large for the stack next to the rest); written and read by the kernel only. */
struct mr_scratch {
	__u8 b[256];
};
BPF_PERCPU_ARRAY(mr_scratch, struct mr_scratch, 1);

/* AF_XDP socket per RX queue index; written by user space (engine). */
BPF_XSKMAP(mr_xsks, MR_MAX_RXQ);

#endif /* __METAROCE_MAPS_H */
