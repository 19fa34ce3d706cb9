"""`metaroce qp` and `metaroce stat`: what the kernel side of an endpoint holds, read
from the maps it pins under /sys/fs/bpf/metaroce/ (like `rdma res show qp` and
`ethtool -S`).  Works while any process runs an endpoint on the interface; needs
no cooperation from that process.

    metaroce qp -d eth1            # one line per QP: state, peer, PSNs, ACK counters, RTT
    metaroce stat -d eth1          # drop reasons and events of the XDP program
    metaroce qp -d eth1 --json

Run it in the endpoint's network namespace with `nsenter --net=/run/netns/NS`
(`ip netns exec` remounts /sys, hiding bpffs).
"""
from __future__ import annotations

import ipaddress
import mmap
import os
from pathlib import Path

import numpy as np

from metaroce_xdp.kern import bpfsys
from metaroce_xdp.kern.layout import QP_STATE_DTYPE, DropReason, Event, QpState
from metaroce_xdp.kern.loader import PIN_ROOT, pin_name


class StatError(Exception):
    pass


def pin_dir(ifname: str, override: str | None = None) -> Path:
    d = Path(override) if override else Path(PIN_ROOT) / pin_name(ifname)
    if not d.is_dir():
        if not os.path.ismount(os.path.dirname(PIN_ROOT)):
            raise StatError(f"bpffs is not mounted at {os.path.dirname(PIN_ROOT)} "
                            "(under `ip netns exec`? use `nsenter --net=/run/netns/NS` instead)")
        raise StatError(f"no MetaRoCE endpoint pinned for {ifname} ({d} missing): is an endpoint running "
                        "on it, in this network namespace?")
    return d


def read_qps(ifname: str, pin: str | None = None) -> list[dict]:
    d = pin_dir(ifname, pin)
    fd = bpfsys.obj_get(str(d / "mr_qps"))
    try:
        info = bpfsys.map_info(fd)
        size = info.max_entries * info.value_size
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        arr = np.frombuffer(mm, dtype=QP_STATE_DTYPE, count=info.max_entries).copy()
    finally:
        mm.close()
    out = []
    for rec in arr[arr["qpn"] != 0]:
        peer = bytes(rec["peer_ip"])
        ip = ipaddress.IPv6Address(peer)
        peer_s = str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ip)
        out.append({
            "qpn": int(rec["qpn"]), "state": QpState(int(rec["state"])).name, "dest_qpn": int(rec["dest_qpn"]),
            "peer": peer_s, "pmtu": int(rec["pmtu"]), "snd_nxt": int(rec["snd_nxt"]),
            "ack_psn": int(rec["ack_psn"]), "acks": int(rec["acks"]), "naks": int(rec["naks"]),
            "rnr_naks": int(rec["rnr_naks"]), "stale_acks": int(rec["stale_acks"]),
            "cnps": int(rec["cnp_count"]), "srtt_us": round(int(rec["srtt_ns"]) / 1000, 1),
        })
    return out


def read_counters(ifname: str, pin: str | None = None) -> dict:
    d = pin_dir(ifname, pin)
    res = {}
    for name, enum_cls in (("mr_drops", DropReason), ("mr_events", Event)):
        fd = bpfsys.obj_get(str(d / name))
        try:
            res[name[3:]] = {m.name: bpfsys.percpu_u64_sum(fd, int(m)) for m in enum_cls}
        finally:
            os.close(fd)
    return res


def format_qps(rows: list[dict]) -> str:
    head = (f"{'QPN':>8} {'STATE':<5} {'PEER':<16} {'DQPN':>8} {'PMTU':>5} {'SND_NXT':>8} {'ACK_PSN':>8} "
            f"{'ACKS':>8} {'NAKS':>6} {'RNR':>5} {'STALE':>6} {'SRTT_US':>8}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['qpn']:>#8x} {r['state']:<5} {r['peer']:<16} {r['dest_qpn']:>#8x} {r['pmtu']:>5} "
                     f"{r['snd_nxt']:>8} {r['ack_psn']:>8} {r['acks']:>8} {r['naks']:>6} {r['rnr_naks']:>5} "
                     f"{r['stale_acks']:>6} {r['srtt_us']:>8}")
    return "\n".join(lines)


def format_counters(c: dict) -> str:
    lines = ["events:"]
    lines += [f"  {k.lower():<16} {v}" for k, v in c["events"].items()]
    lines.append("drops:")
    lines += [f"  {k.lower():<16} {v}" for k, v in c["drops"].items() if v] or ["  (none)"]
    return "\n".join(lines)
