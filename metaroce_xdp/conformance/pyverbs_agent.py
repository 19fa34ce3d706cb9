#!/usr/bin/env python3
"""The test agent of spec 09-conformance.md section 9.4 for any rdma-core device, on pyverbs.

The conformance tester drives an implementation under test (IUT) through this
agent: JSON lines over TCP, one session per connection, each command a thin
translation onto libibverbs through pyverbs (`python3-pyverbs`).  It speaks the
same protocol, commands, value encodings (MR-CONF-018) and error codes
(MR-CONF-023) as metaroce_xdp/agent.py, the reference implementation's agent,
so one tester checks Linux Soft-RoCE (`rdma_rxe`) and RDMA NICs alike.

It needs the Python standard library, pyverbs and agentproto.py (the
protocol, shared with agent.py and the tester) only, because it runs where our
package is not installed: the two files side by side, e.g. inside the Soft-RoCE
VM of tools/rxe_conformance.py (AGENT_FILES):

    python3 pyverbs_agent.py --dev rxe0 --gid-index 1 --listen 10.77.0.2 --port 18516

What the device cannot do is refused with ENOTSUP, never pretended:
  * no connection manager of our own (cm_listen, cm_connect, cm_wait);
  * set_param offers `dscp` (the upper six bits of the address vector's
    traffic class; default 26, MR-ECN-004), `ecn` (1: the traffic class's
    low two bits ECT(0), the default, MR-ECN-001; 0: Not-ECT) and
    `hop_limit`, applied to the QPs that reach RTR afterwards; nothing else
    (no ACK delay, no CNP interval: those live inside the device).  The
    default traffic class is therefore 0x6A, what the spec requires of a
    QP's data packets; Linux RoCE devices put the address vector's traffic
    class in the IP header's TOS byte (Traffic Class) whole, ECN bits too.  Linux RoCE ignores the address vector's
    hop limit and takes the TTL / Hop Limit from the route to the destination
    (ib_resolve_eth_dmac), so `hop_limit` becomes a host route to the dgid's
    address with that hoplimit metric (`ip route replace ... hoplimit N`),
    removed on reset;
  * only the compat profile (plain RoCEv2 RC), only P_Keys in the port's table;
  * reg_mr `remote_invalidate`: ibv_reg_mr gives no remotely invalidatable
    memory region (in rdma-core only memory windows are);
  * per-QP counters (get_counters with `qp`): rdma-core reports per port.
    get_counters returns the port's counters under the kernel's names, and
    under the spec's name too where one counts exactly the same thing
    (SPEC_COUNTERS: rxe's duplicate_request is rx_dup_req).

Mapping notes (the reference agent is the model for each):
  * modify_qp fills the attributes ibv_modify_qp requires but the protocol
    leaves optional with the reference endpoint's defaults (timeout 14,
    retry_cnt 7, rnr_retry 7, min_rnr_timer 12, max_rd_atomic 1,
    max_dest_rd_atomic 1, access none, P_Key 0xffff); a transition outside
    the IBTA table is refused with ESTATE before the device sees it.
    `cur_state`, `alt_path` and `path_mig_state` go to the device as given
    (IBV_QP_CUR_STATE, IBV_QP_ALT_PATH, IBV_QP_PATH_MIG_STATE), so what
    MR-QP-006 and MR-QP-008 judge is the device's answer, not the agent's.
  * `dmac` cannot be given to a verbs device (the kernel resolves the peer's
    MAC from the destination GID's IP address).  The agent therefore makes it
    true the way the kernel learns it: a permanent neighbour entry for the
    dgid's address on the GID's network device (`ip neigh replace`), removed
    again on reset.  Without `dmac` the kernel resolves it (ARP/ND).  These
    kernel edits are shared by the agent's sessions: the last one wins.
  * A post list goes to the device in one ibv_post_send/ibv_post_recv after
    every WR was checked; a device that still refuses one WR keeps the WRs
    before it (the verbs bad_wr rule), and the error message says so.  A
    post refused with ENOMEM (ibv_post_send(3): queue full) is EAGAIN.
  * Immediate data is converted between host order (JSON) and the network
    order of ibv_send_wr/ibv_wc; a completion WITH_INV reports
    `invalidated_rkey`.

MR-SEC-027: the agent is off unless started, binds only the address it is
given (default loopback) and logs every session on stderr.
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time

if __package__:                     # metaroce_xdp.conformance.pyverbs_agent
    from . import agentproto as P
else:                               # run as a file: agentproto.py is beside it (also under python -I)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import agentproto as P

log = logging.getLogger("metaroce.pyverbs_agent")
_T0 = time.monotonic()

VERSION = "0.1.0"

# ---- libibverbs values the device calls take (verbs.h; a stable ABI).  The names the protocol carries and
# their numbers are agentproto's (P.ACCESS, P.SEND_FLAGS, P.QP_STATES, P.WR_OPCODES, P.WC_STATUS, P.WC_OPCODES).
MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
MTU_BYTES = {v: k for k, v in MTU_ENUM.items()}
WC_WITH_IMM, WC_WITH_INV = 2, 8
GID_TYPE_ROCE_V2 = 2                # enum ibv_gid_type
# ibv_qp_attr_mask bits
M_STATE, M_ACCESS, M_PKEY, M_PORT, M_AV, M_MTU, M_TIMEOUT, M_RETRY, M_RNR_RETRY, M_RQ_PSN, M_MAX_RD, \
    M_MIN_RNR, M_SQ_PSN, M_MAX_DEST_RD, M_DEST_QPN = (1, 1 << 3, 1 << 4, 1 << 5, 1 << 7, 1 << 8, 1 << 9, 1 << 10,
                                                     1 << 11, 1 << 12, 1 << 13, 1 << 15, 1 << 16, 1 << 17, 1 << 20)
M_EN_SQD_ASYNC = 1 << 2
M_CUR_STATE, M_ALT_PATH, M_PATH_MIG = 1 << 1, 1 << 14, 1 << 18
MIG_STATES = {"MIGRATED": 0, "REARM": 1, "ARMED": 2}      # enum ibv_mig_state
# IBTA 10.3.1 / ib_modify_qp_is_ok: the transitions a consumer may request (RESET and ERR from anywhere).
TRANSITIONS = {"RESET": {"INIT"}, "INIT": {"INIT", "RTR"}, "RTR": {"RTS"}, "RTS": {"RTS", "SQD"},
               "SQD": {"SQD", "RTS"}, "SQE": {"RTS"}, "ERR": set()}
# What the reference endpoint uses when modify_qp leaves an attribute out (dp/context.py QP); ibv_modify_qp
# needs them for INIT -> RTR and RTR -> RTS.
DEFAULTS = {"timeout": 14, "retry_cnt": 7, "rnr_retry": 7, "min_rnr_timer": 12, "max_rd_atomic": 1,
            "max_dest_rd_atomic": 1}
HOP_LIMIT = 64
# set_param (9.4.2): name -> (default, min, max); the session's values go into the AV at RTR.
PARAMS = {"hop_limit": (HOP_LIMIT, 1, 255), "dscp": (26, 0, 63), "ecn": (1, 0, 1)}
ECT0 = 0b10
# Spec counter names (03-compat-rc.md etc.) that a kernel port counter matches exactly: rxe's
# duplicate_request counts every duplicate request its responders see (rxe_resp.c check_psn), which is
# what MR-DUP-010's rx_dup_req counts.  Port-wide: rdma-core has no per-QP counters to offer.
SPEC_COUNTERS = {"rx_dup_req": "duplicate_request"}


def gid_hex(gid_text: str) -> str:
    """pyverbs' 'xxxx:xxxx:...' GID text -> 32 lowercase hex digits (MR-CONF-018)."""
    h = gid_text.replace(":", "").lower()
    if len(h) != 32 or not re.fullmatch(r"[0-9a-f]{32}", h):
        raise ValueError(f"not a GID: {gid_text!r}")
    return h


def gid_text(gid32: str) -> str:
    """32 hex digits -> pyverbs' 8-word GID text."""
    return ":".join(gid32[i:i + 4] for i in range(0, 32, 4))


# ---- the device ----------------------------------------------------------------------------
class Device:
    """One opened rdma-core device and port, with what hello and caps report about it.

    Opened once per agent process and shared by its sessions (an ibv_context is
    thread-safe); everything it reports is queried from the device."""

    def __init__(self, name: str | None, port: int = 1, gid_index: int | None = None,
                 timer_granularity_us: int | None = None) -> None:
        import pyverbs.device as d                  # imported here: --help works without pyverbs
        if name is None:
            names = [x.name.decode() if isinstance(x.name, bytes) else x.name for x in d.get_device_list()]
            if not names:
                raise RuntimeError("no RDMA device (ibv_get_device_list is empty)")
            name = names[0]
        self.name = name
        self.port = port
        self.ctx = d.Context(name=name)
        self.attr = self.ctx.query_device()
        self.port_attr = self.ctx.query_port(port)
        self.gid_index = self._pick_gid(gid_index)
        entry = self.ctx.query_gid_ex(port, self.gid_index)
        self.gid = gid_hex(entry.gid_str())
        self.ip = P.ip_of_gid(self.gid)
        self.netdev = socket.if_indextoname(entry.ndev_ifindex) if entry.ndev_ifindex else None
        self.mac = self._read(f"/sys/class/net/{self.netdev}/address") if self.netdev else None
        self.active_mtu = MTU_BYTES.get(self.port_attr.active_mtu, 1024)
        self.pkeys = self._pkeys()
        self.driver = self._driver()
        self.timer_granularity_us = timer_granularity_us or self._timer_granularity()
        self.max_inline = self._probe_max_inline()
        self.lock = threading.Lock()               # serialises the neighbour and route edits

    # what the device says about itself
    def _pick_gid(self, want: int | None) -> int:
        """The RoCEv2 GID to use: `want` if given (checked), else the first IPv4-mapped RoCEv2 one."""
        n = min(self.port_attr.gid_tbl_len, 256)
        entries = []
        for i in range(n):
            try:
                e = self.ctx.query_gid_ex(self.port, i)
            except Exception:
                continue
            g = gid_hex(e.gid_str())
            if int(g, 16) == 0:
                continue
            entries.append((i, g, e.gid_type))
        if want is not None:
            for i, g, t in entries:
                if i == want:
                    if t != GID_TYPE_ROCE_V2:
                        raise RuntimeError(f"GID index {want} ({gid_text(g)}) is not RoCE v2")
                    return want
            raise RuntimeError(f"GID index {want} is empty on {self.port}; table: {entries}")
        for i, g, t in entries:
            if t == GID_TYPE_ROCE_V2 and g.startswith("00000000000000000000ffff"):
                return i
        for i, g, t in entries:
            if t == GID_TYPE_ROCE_V2:
                return i
        raise RuntimeError("no RoCE v2 GID on the port (is the link up and addressed?)")

    def _pkeys(self) -> list:
        out = []
        for i in range(64):
            try:
                out.append(self.ctx.query_pkey(self.port, i))
            except Exception:
                break
        return out

    @staticmethod
    def _read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    def _driver(self) -> str:
        """The kernel driver behind the device: sysfs for a NIC; Soft-RoCE has no bus device but
        a vendor ID of its own (RXE_VENDOR_ID 0xffffff)."""
        link = f"/sys/class/infiniband/{self.name}/device/driver"
        if os.path.islink(link):
            return os.path.basename(os.readlink(link))
        if self.attr.vendor_id == 0xFFFFFF:
            return "rdma_rxe"
        return "unknown"

    def _timer_granularity(self) -> int:
        """rxe runs its retransmission and RNR timers on jiffies: 1 / CONFIG_HZ.  For other
        devices the granularity is not discoverable; 1000 us is claimed (--timer-granularity-us
        corrects it)."""
        if self.driver == "rdma_rxe":
            cfg = self._read(f"/boot/config-{platform.release()}") or ""
            m = re.search(r"^CONFIG_HZ=(\d+)$", cfg, re.M)
            if m:
                return max(1, 1_000_000 // int(m.group(1)))
        return 1000

    def _probe_max_inline(self) -> int:
        """The largest max_inline_data the device accepts for an RC QP (verbs has no attribute
        for it): a bisection of throw-away QPs, done once."""
        from pyverbs.cq import CQ
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPCap, QPInitAttr
        pd, cq = PD(self.ctx), CQ(self.ctx, 4)
        try:
            def ok(n: int) -> bool:
                try:
                    QP(pd, QPInitAttr(qp_type=2, scq=cq, rcq=cq, cap=QPCap(1, 1, 1, 1, n), sq_sig_all=0)).close()
                    return True
                except Exception:
                    return False
            if not ok(0):
                return 0
            lo, hi = 0, 1
            while hi <= 65536 and ok(hi):
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if ok(mid) else (lo, mid)
            return lo
        finally:
            cq.close()
            pd.close()

    @property
    def mtus(self) -> list:
        return [m for m in sorted(MTU_ENUM) if m <= self.active_mtu]

    @property
    def caps(self) -> int:
        c = P.CAP_ATOMICS if self.attr.atomic_caps else 0
        a = ipaddress.ip_address(self.ip)
        if a.version == 6 and not a.is_link_local:        # the agent's QPs use the one GID it opened
            c |= P.CAP_IPV6
        return c

    def limits(self) -> dict:
        a = self.attr
        return {"max_qp": a.max_qp, "max_cq": a.max_cq, "max_mr": a.max_mr, "max_sge": a.max_sge,
                "max_inline": self.max_inline, "max_rd_atomic": a.max_qp_rd_atom}

    def version(self) -> str:
        return (f"{self.driver} on Linux {platform.release()}, fw {self.attr.fw_version or '-'}; "
                f"pyverbs agent {VERSION}")

    def counter_dirs(self) -> list:
        base = f"/sys/class/infiniband/{self.name}/ports/{self.port}"
        return [os.path.join(base, d) for d in ("counters", "hw_counters") if os.path.isdir(os.path.join(base, d))]

    def counters(self) -> dict:
        """The port's counters as the kernel exports them (counters/ and hw_counters/), plus the
        spec's name for each one that counts exactly what a spec counter counts (SPEC_COUNTERS)."""
        out = {}
        for d in self.counter_dirs():
            for name in sorted(os.listdir(d)):
                if name == "lifespan":              # hw_counters' refresh period, not a counter
                    continue
                v = self._read(os.path.join(d, name))
                if v is not None and v.isdigit():
                    out[name] = int(v)
        for spec_name, kernel_name in SPEC_COUNTERS.items():
            if kernel_name in out:
                out[spec_name] = out[kernel_name]
        return out

    # the peer's MAC: the kernel's neighbour table is how a verbs device learns it
    def set_neighbour(self, ip: str, mac: str) -> None:
        if not self.netdev:
            raise P.AgentError("ENOTSUP", "the GID has no network device: dmac cannot be applied")
        self._ip(["neigh", "replace", ip, "lladdr", mac, "dev", self.netdev, "nud", "permanent"])

    def del_neighbour(self, ip: str) -> None:
        try:
            self._ip(["neigh", "del", ip, "dev", self.netdev])
        except P.AgentError as e:
            log.warning("cannot remove neighbour %s: %s", ip, e.message)

    # the TTL / Hop Limit: Linux RoCE takes it from the route to the destination
    def set_route(self, ip: str, hop: int) -> None:
        if not self.netdev:
            raise P.AgentError("ENOTSUP", "the GID has no network device: hop_limit cannot be applied")
        plen = 32 if ipaddress.ip_address(ip).version == 4 else 128
        self._ip(["route", "replace", f"{ip}/{plen}", "dev", self.netdev, "hoplimit", str(hop)])

    def del_route(self, ip: str) -> None:
        plen = 32 if ipaddress.ip_address(ip).version == 4 else 128
        try:
            self._ip(["route", "del", f"{ip}/{plen}", "dev", self.netdev])
        except P.AgentError as e:
            log.warning("cannot remove route %s: %s", ip, e.message)

    def neighbour(self, ip: str) -> str | None:
        """The MAC the kernel has for ip on our netdev, if any."""
        out = self._ip(["neigh", "show", ip, "dev", self.netdev])
        m = re.search(r"lladdr ([0-9a-f:]{17})", out)
        return m.group(1) if m else None

    @staticmethod
    def _ip(argv: list) -> str:
        try:
            cp = subprocess.run(["ip"] + argv, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise P.AgentError("EINTERNAL", f"ip {' '.join(argv)}: {e}") from None
        if cp.returncode != 0:
            raise P.AgentError("EINTERNAL", f"ip {' '.join(argv)}: {cp.stderr.strip()}")
        return cp.stdout


# ---- one session ---------------------------------------------------------------------------
class _QPEntry:
    def __init__(self, qp, pd: int, send_cq: int, recv_cq: int, cap: dict, sig_all: bool) -> None:
        self.qp, self.pd, self.send_cq, self.recv_cq, self.cap, self.sig_all = qp, pd, send_cq, recv_cq, cap, sig_all


class _MREntry:
    def __init__(self, mr, pd: int, length: int) -> None:
        self.mr, self.pd, self.length = mr, pd, length


class Agent(P.Session):
    """One test-agent session on a Device: its handles, its commands, its reset.

    handle(request) -> response never raises.  Every command decodes and checks
    all of its arguments before the one verbs call that acts, so a failed
    command leaves the IUT as it was (MR-CONF-016)."""

    def __init__(self, dev: Device) -> None:
        super().__init__()
        self.dev = dev
        self.pds: dict = {}
        self.mrs: dict = {}
        self.cqs: dict = {}
        self.qps: dict = {}
        self.kernel_edits: set = set()            # ("neigh" | "route", ip) made for this session's QPs
        self.params = {k: v[0] for k, v in PARAMS.items()}
        self.params_set: set = set()

    def call(self, cmd: str, fn, args: dict):
        """Run one command; name pyverbs' failures by their errno (MR-CONF-023)."""
        from pyverbs.pyverbs_error import PyverbsRDMAError, PyverbsUserError
        try:
            return fn(args)
        except P.AgentError:
            raise
        except PyverbsRDMAError as e:
            raise P.AgentError(P.ERRNO_CODES.get(e.error_code, "EINTERNAL"), str(e)) from None
        except PyverbsUserError as e:
            raise P.AgentError("EINVAL", str(e)) from None
        except MemoryError as e:
            raise P.AgentError("ENOMEM", f"out of memory: {e}") from None
        except OSError as e:
            raise P.AgentError(P.ERRNO_CODES.get(e.errno, "EINTERNAL"), f"{type(e).__name__}: {e}") from None
        except Exception as e:                     # never a crash: the session goes on
            log.exception("agent: %s failed", cmd)
            raise P.AgentError("EINTERNAL", f"{type(e).__name__}: {e}") from None

    # -- session -------------------------------------------------------------------------
    def cmd_hello(self, args: dict) -> dict:
        P.check_hello(args)
        d = self.dev
        self.greeted = True
        return {"proto": P.PROTO, "impl": f"rdma-core:{d.name}", "version": d.version(), "profiles": ["compat"],
                "caps": d.caps, "gid": d.gid, "ip": d.ip, "mac": d.mac, "mtus": d.mtus, "limits": d.limits(),
                "timer_granularity_us": d.timer_granularity_us, "gid_index": d.gid_index, "netdev": d.netdev}

    def cmd_caps(self, args: dict) -> dict:
        # Native-profile knobs do not exist on a verbs device: their trivial values
        # (no SACK window, one source port per QP, no ACK coalescing beyond AckReq).
        rto_min = self.dev.timer_granularity_us if self.dev.driver == "rdma_rxe" else 8
        return {"caps": self.dev.caps,
                "defaults": {"sack_window": 0, "entropy_count": 1, "ack_coalesce_us": 0, "ack_coalesce_pkts": 1,
                             "rto_min_us": rto_min},
                "dcqcn": False, "counters": sorted(self.dev.counters()), "params": sorted(PARAMS),
                # 9.4.2: no cm_* (ENOTSUP: connect with modify_qp), no per-QP counters (rdma-core counts per port)
                "commands": sorted(c for c in self.commands if not c.startswith("cm_")),
                "qp_counters": []}

    def cmd_reset(self, args: dict) -> None:
        self.reset()

    def reset(self) -> None:
        """MR-CONF-021: destroy every QP, MR, CQ and PD of the session; undo its neighbour and route
        entries; restore the set_param values.
        Never raises: what fails to go is logged and forgotten."""
        closers = ((self.qps, lambda e: e.qp.close()), (self.mrs, lambda e: e.mr.close()),
                   (self.cqs, lambda cq: cq.close()), (self.pds, lambda pd: pd.close()))
        for table, close in closers:
            for h, obj in list(table.items()):
                try:
                    close(obj)
                except Exception:
                    log.exception("agent reset: cannot destroy handle %d", h)
            table.clear()
        with self.dev.lock:
            for kind, ip in sorted(self.kernel_edits):
                (self.dev.del_neighbour if kind == "neigh" else self.dev.del_route)(ip)
        self.kernel_edits.clear()
        self.params = {k: v[0] for k, v in PARAMS.items()}
        self.params_set.clear()
        self._restart_handles()

    # -- PD, MR, CQ ----------------------------------------------------------------------
    def cmd_create_pd(self, args: dict) -> dict:
        from pyverbs.pd import PD
        pd = PD(self.dev.ctx)
        h = self._new_handle("pd")
        self.pds[h] = pd
        return {"pd": h}

    def cmd_dealloc_pd(self, args: dict) -> None:
        h, pd = self._lookup(self.pds, "pd", args)
        users = [f"mr {m}" for m, e in self.mrs.items() if e.pd == h] + \
                [f"qp {q}" for q, e in self.qps.items() if e.pd == h]
        if users:                # pyverbs' PD.close() would close them; ibv_dealloc_pd says EBUSY
            raise P.AgentError("EBUSY", f"PD {h} is used by {', '.join(users)}: release them first")
        pd.close()
        del self.pds[h]

    def cmd_reg_mr(self, args: dict) -> dict:
        from pyverbs.mr import MR
        pd_h, pd = self._lookup(self.pds, "pd", args)
        n = P.get_int(args, "len", 0, 1 << 62)
        if n > P.MAX_MR_LEN:
            raise P.AgentError("ENOMEM", f"len {n} exceeds the agent's MR limit of {P.MAX_MR_LEN} bytes")
        access = P.get_flags(args, "access", P.ACCESS)
        fill = P.get_int(args, "fill", 0, 255, 0)
        inval = P.get(args, "remote_invalidate", False)
        if not isinstance(inval, bool):
            raise P.AgentError("EINVAL", "remote_invalidate must be true or false")
        if inval:
            # ibv_reg_mr gives a memory region no remote invalidation: in rdma-core only
            # memory windows and fast-registered MRs (kernel consumers) are invalidatable.
            raise P.AgentError("ENOTSUP", "remote_invalidate: a user MR of an rdma-core device cannot be "
                                        "invalidated remotely (only memory windows can)")
        from pyverbs.pyverbs_error import PyverbsRDMAError, PyverbsError
        try:
            mr = MR(pd, n, access)
        except PyverbsRDMAError:
            raise
        except PyverbsError as exc:             # pyverbs could not allocate the buffer itself
            raise P.AgentError("ENOMEM", str(exc)) from None
        try:
            if fill:
                chunk = bytes([fill]) * min(n, 1 << 20)
                for off in range(0, n, len(chunk)):
                    k = min(len(chunk), n - off)
                    mr.write(chunk[:k], k, off)
        except BaseException:
            mr.close()
            raise
        h = self._new_handle("mr")
        self.mrs[h] = _MREntry(mr, pd_h, n)
        return {"mr": h, "lkey": mr.lkey, "rkey": mr.rkey, "va": P.hex64(mr.buf), "len": n}

    def cmd_dereg_mr(self, args: dict) -> None:
        h, e = self._lookup(self.mrs, "mr", args)
        e.mr.close()
        del self.mrs[h]

    def cmd_create_cq(self, args: dict) -> dict:
        from pyverbs.cq import CQ
        cqe = P.get_int(args, "cqe", 1, P.MAX_CQE)
        cq = CQ(self.dev.ctx, cqe)
        h = self._new_handle("cq")
        self.cqs[h] = cq
        return {"cq": h, "cqe": cq.cqe}

    def cmd_destroy_cq(self, args: dict) -> None:
        h, cq = self._lookup(self.cqs, "cq", args)
        users = [f"qp {q}" for q, e in self.qps.items() if h in (e.send_cq, e.recv_cq)]
        if users:                # pyverbs' CQ.close() would destroy the QPs; ibv_destroy_cq says EBUSY
            raise P.AgentError("EBUSY", f"CQ {h} is used by {', '.join(users)}: destroy the QPs first")
        cq.close()
        del self.cqs[h]

    # -- QP --------------------------------------------------------------------------------
    def cmd_create_qp(self, args: dict) -> dict:
        from pyverbs.qp import QP, QPCap, QPInitAttr
        pd_h, pd = self._lookup(self.pds, "pd", args)
        scq_h, scq = self._lookup(self.cqs, "cq", args, "send_cq")
        rcq_h, rcq = self._lookup(self.cqs, "cq", args, "recv_cq")
        qtype = P.get(args, "type", "RC")
        if qtype != "RC":
            raise P.AgentError("ENOTSUP", f"QP type {qtype!r}: only RC")
        cap = P.get_obj(args, "cap", {})
        lim = self.dev.limits()
        qcap = QPCap(max_send_wr=P.get_int(cap, "max_send_wr", 1, P.MAX_WR, 1024),
                     max_recv_wr=P.get_int(cap, "max_recv_wr", 1, P.MAX_WR, 1024),
                     max_send_sge=P.get_int(cap, "max_send_sge", 0, lim["max_sge"], min(16, lim["max_sge"])),
                     max_recv_sge=P.get_int(cap, "max_recv_sge", 0, lim["max_sge"], min(16, lim["max_sge"])),
                     max_inline_data=P.get_int(cap, "max_inline_data", 0, lim["max_inline"], 0))
        sig_all = P.get(args, "sq_sig_all", False)
        if not isinstance(sig_all, bool):
            raise P.AgentError("EINVAL", "sq_sig_all must be true or false")
        init = QPInitAttr(qp_type=2, scq=scq, rcq=rcq, cap=qcap, sq_sig_all=int(sig_all))   # IBV_QPT_RC
        qp = QP(pd, init)
        got = init.cap                                       # what the device granted
        granted = {"max_send_wr": got.max_send_wr, "max_recv_wr": got.max_recv_wr,
                   "max_send_sge": got.max_send_sge, "max_recv_sge": got.max_recv_sge,
                   "max_inline_data": got.max_inline_data}
        h = self._new_handle("qp")
        self.qps[h] = _QPEntry(qp, pd_h, scq_h, rcq_h, granted, sig_all)
        return {"qp": h, "qpn": qp.qp_num}

    def cmd_destroy_qp(self, args: dict) -> None:
        h, e = self._lookup(self.qps, "qp", args)
        e.qp.close()
        del self.qps[h]

    def _state(self, qp) -> str:
        """The QP's state as the device has it (it moves to SQE/ERR on its own)."""
        attr, _ = qp.query(M_STATE)
        return P.QP_STATE_NAMES.get(attr.qp_state, str(attr.qp_state))

    def _pkey_index(self, pkey: int) -> int:
        for i, p in enumerate(self.dev.pkeys):
            if p & 0x7FFF == pkey & 0x7FFF and (p & 0x8000 or not pkey & 0x8000):
                return i
        raise P.AgentError("ENOTSUP", f"pkey {pkey:#06x} is not in the port's P_Key table "
                                    f"{[hex(p) for p in self.dev.pkeys]}")

    def _qp_attr(self, cur: str, state: str, attrs: dict):
        """modify_qp attrs (section 9.4.2) -> (pyverbs QPAttr, ibv_qp_attr_mask, kernel path edits)."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr
        a = QPAttr(qp_state=P.QP_STATES[state], port_num=self.dev.port)
        mask = M_STATE
        edits = []                                   # (kind, ip, value) for the kernel's path to dgid
        fresh = {"INIT": cur == "RESET", "RTR": cur == "INIT", "RTS": cur == "RTR"}.get(state, False)

        if "access" in attrs or (state == "INIT" and fresh):
            a.qp_access_flags = P.get_flags(attrs, "access", P.ACCESS, [])
            mask |= M_ACCESS
        if "pkey" in attrs or (state == "INIT" and fresh):
            a.pkey_index = self._pkey_index(P.get_int(attrs, "pkey", 0, 0xFFFF, 0xFFFF))
            mask |= M_PKEY
        if state == "INIT" and fresh:
            a.port_num = self.dev.port
            mask |= M_PORT
        if "dest_qpn" in attrs:
            a.dest_qp_num = P.get_int(attrs, "dest_qpn", 1, 0xFFFFFF)
            mask |= M_DEST_QPN
        if "rq_psn" in attrs:
            a.rq_psn = P.get_int(attrs, "rq_psn", 0, 0xFFFFFF)
            mask |= M_RQ_PSN
        if "sq_psn" in attrs:
            a.sq_psn = P.get_int(attrs, "sq_psn", 0, 0xFFFFFF)
            mask |= M_SQ_PSN
        if "path_mtu" in attrs:
            mtu = P.get_int(attrs, "path_mtu", 0, 1 << 31)
            if mtu not in self.dev.mtus:
                raise P.AgentError("EINVAL", f"path_mtu {mtu}: use one of {self.dev.mtus}")
            a.path_mtu = MTU_ENUM[mtu]
            mask |= M_MTU
        if "dgid" in attrs:
            g = attrs["dgid"]
            if not isinstance(g, str) or len(g) != 32 or not P.HEX.fullmatch(g):
                raise P.AgentError("EINVAL", f"dgid {g!r} is not 32 hex digits")
            g = g.lower()
            hop = P.get_int(attrs, "hop_limit", 1, 255, self.params["hop_limit"])
            tclass = P.get_int(attrs, "traffic_class", 0, 255,
                               self.params["dscp"] << 2 | (ECT0 if self.params["ecn"] else 0))
            gr = GlobalRoute(dgid=GID(gid_text(g)), sgid_index=self.dev.gid_index, hop_limit=hop,
                             traffic_class=tclass)
            a.ah_attr = AHAttr(is_global=1, port_num=self.dev.port, gr=gr)
            mask |= M_AV
            if "dmac" in attrs:
                m = attrs["dmac"]
                if not isinstance(m, str) or not P.MAC.fullmatch(m):
                    raise P.AgentError("EINVAL", f"dmac {m!r} is not aa:bb:cc:dd:ee:ff")
                edits.append(("neigh", P.ip_of_gid(g), m.lower()))
            if "hop_limit" in attrs or "hop_limit" in self.params_set:
                edits.append(("route", P.ip_of_gid(g), hop))
        elif "dmac" in attrs:
            raise P.AgentError("EINVAL", "dmac without dgid: a verbs device takes the peer's MAC from its GID")
        # Any transition (9.4.2): handed to the device as given, for the device to accept or refuse
        # (MR-QP-006, MR-QP-008); an attribute the agent dropped would make the device's answer the agent's.
        if "cur_state" in attrs:                     # IBV_QP_CUR_STATE
            a.cur_qp_state = P.QP_STATES[P.get_enum(attrs, "cur_state", P.QP_STATES)]
            mask |= M_CUR_STATE
        if "path_mig_state" in attrs:                # IBV_QP_PATH_MIG_STATE
            a.path_mig_state = MIG_STATES[P.get_enum(attrs, "path_mig_state", MIG_STATES)]
            mask |= M_PATH_MIG
        if "alt_path" in attrs:                      # IBV_QP_ALT_PATH: {dgid, dmac, port_num, timeout, pkey}
            alt = P.get_obj(attrs, "alt_path")
            g = alt.get("dgid")
            if not isinstance(g, str) or len(g) != 32 or not P.HEX.fullmatch(g):
                raise P.AgentError("EINVAL", f"alt_path dgid {g!r} is not 32 hex digits")
            g = g.lower()
            port = P.get_int(alt, "port_num", 1, 255, self.dev.port)
            gr = GlobalRoute(dgid=GID(gid_text(g)), sgid_index=self.dev.gid_index,
                             hop_limit=P.get_int(alt, "hop_limit", 1, 255, self.params["hop_limit"]),
                             traffic_class=P.get_int(alt, "traffic_class", 0, 255,
                                                     self.params["dscp"] << 2 | (ECT0 if self.params["ecn"] else 0)))
            a.alt_ah_attr = AHAttr(is_global=1, port_num=port, gr=gr)
            a.alt_port_num = port
            a.alt_timeout = P.get_int(alt, "timeout", 0, 31, DEFAULTS["timeout"])
            a.alt_pkey_index = self._pkey_index(P.get_int(alt, "pkey", 0, 0xFFFF, 0xFFFF))
            mask |= M_ALT_PATH
            if "dmac" in alt:
                m = alt["dmac"]
                if not isinstance(m, str) or not P.MAC.fullmatch(m):
                    raise P.AgentError("EINVAL", f"alt_path dmac {m!r} is not aa:bb:cc:dd:ee:ff")
                if ("neigh", P.ip_of_gid(g), m.lower()) not in edits:
                    edits.append(("neigh", P.ip_of_gid(g), m.lower()))
        for name, bit, hi in (("max_dest_rd_atomic", M_MAX_DEST_RD, 16), ("min_rnr_timer", M_MIN_RNR, 31)):
            if name in attrs or (fresh and state == "RTR"):      # given, or needed by INIT -> RTR
                setattr(a, name, P.get_int(attrs, name, 0, hi, DEFAULTS[name]))
                mask |= bit
        for name, bit, hi in (("timeout", M_TIMEOUT, 31), ("retry_cnt", M_RETRY, 7), ("rnr_retry", M_RNR_RETRY, 7),
                              ("max_rd_atomic", M_MAX_RD, 16)):
            if name in attrs or (fresh and state == "RTS"):      # given, or needed by RTR -> RTS
                setattr(a, name, P.get_int(attrs, name, 0, hi, DEFAULTS[name]))
                mask |= bit
        if "en_sqd_async_notify" in attrs:
            v = attrs["en_sqd_async_notify"]
            if not isinstance(v, bool):
                raise P.AgentError("EINVAL", "en_sqd_async_notify must be true or false")
            a.en_sqd_async_notify = int(v)
            mask |= M_EN_SQD_ASYNC
        profile = P.get_enum(attrs, "profile", P.PROFILES, "compat")
        if profile != "compat":
            raise P.AgentError("ENOTSUP", "profile native: an rdma-core device implements RoCEv2 (compat) only")
        if attrs.get("native"):
            raise P.AgentError("ENOTSUP", "native parameters: an rdma-core device implements compat only")
        return a, mask, edits

    def cmd_modify_qp(self, args: dict) -> None:
        _, e = self._lookup(self.qps, "qp", args)
        state = P.get_enum(args, "state", P.QP_STATES)
        attrs = P.get_obj(args, "attrs", {})
        cur = self._state(e.qp)
        if state not in ("RESET", "ERR") and state not in TRANSITIONS[cur]:
            raise P.AgentError("ESTATE", f"{cur} -> {state} not allowed")
        attr, mask, edits = self._qp_attr(cur, state, attrs)
        added = []
        try:
            with self.dev.lock:
                for kind, ip, value in edits:
                    if kind == "neigh" and self.dev.neighbour(ip) != value:
                        self.dev.set_neighbour(ip, value)
                        added.append((kind, ip))
                    elif kind == "route":
                        self.dev.set_route(ip, value)
                        added.append((kind, ip))
            e.qp.modify(attr, mask)
        except BaseException:
            with self.dev.lock:                 # a failed command leaves the kernel's tables as they were
                for kind, ip in added:
                    if (kind, ip) not in self.kernel_edits:
                        (self.dev.del_neighbour if kind == "neigh" else self.dev.del_route)(ip)
            raise
        self.kernel_edits.update(added)

    def cmd_query_qp(self, args: dict) -> dict:
        _, e = self._lookup(self.qps, "qp", args)
        a, _ = e.qp.query(0x1FFFFF)
        dgid = None
        ah = a.ah_attr
        if ah.is_global and int(gid_hex(ah.dgid), 16):
            dgid = gid_hex(ah.dgid)
        attrs = {"qpn": e.qp.qp_num, "dest_qpn": a.dest_qp_num, "dgid": dgid,
                 "dmac": self._dmac(dgid), "path_mtu": MTU_BYTES.get(a.path_mtu, 0), "sq_psn": a.sq_psn,
                 "rq_psn": a.rq_psn, "access": P.flag_names(a.qp_access_flags, P.ACCESS), "timeout": a.timeout,
                 "retry_cnt": a.retry_cnt, "rnr_retry": a.rnr_retry, "min_rnr_timer": a.min_rnr_timer,
                 "max_rd_atomic": a.max_rd_atomic, "max_dest_rd_atomic": a.max_dest_rd_atomic,
                 "max_send_wr": e.cap["max_send_wr"], "max_recv_wr": e.cap["max_recv_wr"],
                 "max_inline_data": e.cap["max_inline_data"], "pkey_index": a.pkey_index}
        return {"state": P.QP_STATE_NAMES.get(a.qp_state, str(a.qp_state)), "attrs": attrs, "profile": "compat",
                "agreed_caps": 0}

    def _dmac(self, dgid: str | None) -> str | None:
        if dgid is None or not self.dev.netdev:
            return None
        try:
            return self.dev.neighbour(P.ip_of_gid(dgid))
        except P.AgentError:
            return None

    # -- work requests -------------------------------------------------------------------
    def _sges(self, wr: dict) -> list:
        """[(addr, length, lkey)] of a WR's sg_list, each inside its MR."""
        out = []
        for i, s in enumerate(P.get_list(wr, "sg_list", [])):
            if not isinstance(s, dict):
                raise P.AgentError("EINVAL", f"sg_list[{i}] must be an object {{mr, offset, len}}")
            _, m = self._lookup(self.mrs, "mr", s)
            off = P.get_int(s, "offset", 0, 1 << 62, 0)
            n = P.get_int(s, "len", 0, 1 << 62)
            if off + n > m.length:
                raise P.AgentError("EINVAL", f"sg_list[{i}]: offset {off} + len {n} is past the MR's {m.length} bytes")
            out.append((m.mr.buf + off, n, m.mr.lkey))
        return out

    @staticmethod
    def _sge_objs(sges: list):
        from pyverbs.wr import SGE
        if sges:
            return [SGE(a, n, k) for a, n, k in sges], len(sges)
        return [SGE(0, 0, 0)], 0            # pyverbs wants one SGE; num_sge is set back to 0 below

    def _send_wr(self, wr: dict, e: _QPEntry):
        from pyverbs.wr import SendWR
        opname = P.get_enum(wr, "opcode", P.WR_OPCODES)
        op = P.WR_OPCODES[opname]
        flags = P.get_flags(wr, "flags", P.SEND_FLAGS, ["SIGNALED"])       # absent: signaled; [] for unsignaled
        wr_id = P.get_u64(wr, "wr_id")
        sges = self._sges(wr)
        if flags & P.SEND_FLAGS["INLINE"]:
            n = sum(s[1] for s in sges)
            if n > e.cap["max_inline_data"]:
                raise P.AgentError("EINVAL", f"INLINE of {n} bytes > the QP's max_inline_data "
                                           f"{e.cap['max_inline_data']}")
        word = 0
        if opname in ("SEND_WITH_IMM", "RDMA_WRITE_WITH_IMM"):
            word = socket.htonl(P.get_int(wr, "imm", 0, 0xFFFFFFFF))        # ibv_send_wr.imm_data is __be32
        elif opname == "SEND_WITH_INV":
            word = P.get_int(wr, "invalidate_rkey", 0, 0xFFFFFFFF)           # the union's host-order member
        remote = None
        if opname.startswith(("RDMA_", "ATOMIC_")):
            r = P.get_obj(wr, "remote")
            remote = (P.get_u64(r, "va"), P.get_int(r, "rkey", 0, 0xFFFFFFFF))
        compare = swap = 0
        if opname == "ATOMIC_FETCH_AND_ADD":
            compare = P.get_u64(wr, "swap_add")
        elif opname == "ATOMIC_CMP_AND_SWP":
            compare, swap = P.get_u64(wr, "compare"), P.get_u64(wr, "swap_add")
        sg, num = self._sge_objs(sges)
        try:
            s = SendWR(wr_id=wr_id, opcode=op, num_sge=len(sg), sg=sg, send_flags=flags, imm_data=word)
        finally:
            _close_all(sg)                    # SendWR copied them
        s.num_sge = num
        if opname.startswith("RDMA_"):
            s.set_wr_rdma(remote[1], remote[0])
        elif opname.startswith("ATOMIC_"):
            s.set_wr_atomic(remote[1], remote[0], compare, swap)
        return s

    def _recv_wr(self, wr: dict):
        from pyverbs.wr import RecvWR
        wr_id = P.get_u64(wr, "wr_id")
        sg, num = self._sge_objs(self._sges(wr))
        try:
            r = RecvWR(wr_id=wr_id, num_sge=len(sg), sg=sg)
        finally:
            _close_all(sg)
        r.num_sge = num
        return r

    def _post(self, e: _QPEntry, wrs: list, send: bool) -> None:
        """One ibv_post_* of the whole chain.  The pyverbs objects are kept in `wrs` until
        the call returns: each next pointer refers into the following object."""
        for a, b in zip(wrs, wrs[1:]):
            a.next_wr = b
        from pyverbs.pyverbs_error import PyverbsRDMAError
        try:
            (e.qp.post_send if send else e.qp.post_recv)(wrs[0])
        except PyverbsRDMAError as exc:
            what = "post_send" if send else "post_recv"
            state = self._state(e.qp)
            if state in (("RESET", "INIT", "RTR") if send else ("RESET",)):
                raise P.AgentError("ESTATE", f"{what} in state {state}: {exc}") from None
            note = (f" (of the {len(wrs)} chained work requests the device keeps those before the one it "
                    "refused: the verbs bad_wr rule)") if len(wrs) > 1 else ""
            # ibv_post_send(3): ENOMEM is "queue full" for a post -- the protocol's EAGAIN
            code = "EAGAIN" if exc.error_code == errno.ENOMEM else P.ERRNO_CODES.get(exc.error_code, "EINTERNAL")
            raise P.AgentError(code, f"{what}: {exc}{note}") from None

    def cmd_post_send(self, args: dict) -> None:
        _, e = self._lookup(self.qps, "qp", args)
        self._build_and_post(e, P.get_wrs(args), self._send_wr, True)

    def cmd_post_recv(self, args: dict) -> None:
        _, e = self._lookup(self.qps, "qp", args)
        self._build_and_post(e, P.get_wrs(args), lambda w, _: self._recv_wr(w), False)

    def _build_and_post(self, e: _QPEntry, specs: list, build, send: bool) -> None:
        """Every WR built (and so checked) before the post; their C memory freed afterwards
        (pyverbs 44 frees a WR's sg_list only in close())."""
        wrs: list = []
        try:
            for w in specs:
                wrs.append(build(w, e))
            self._post(e, wrs, send)
        finally:
            _close_all(wrs)

    def cmd_poll_cq(self, args: dict) -> dict:
        _, cq = self._lookup(self.cqs, "cq", args)
        n = P.get_int(args, "max", 1, P.MAX_POLL, 16)
        timeout_ms = P.get_int(args, "timeout_ms", 0, P.MAX_TIMEOUT_MS, 0)
        deadline = time.monotonic() + timeout_ms / 1000
        _, wcs = cq.poll(n)
        while not wcs and time.monotonic() < deadline:          # MR-CONF-020: at most timeout_ms
            time.sleep(min(0.0005, max(0.0, deadline - time.monotonic())))
            _, wcs = cq.poll(n)
        return {"completions": [self._wc(w) for w in wcs]}

    @staticmethod
    def _wc(wc) -> dict:
        st = wc.status
        d = {"wr_id": P.hex64(wc.wr_id),
             "status": "IBV_WC_" + (P.WC_STATUS[st] if 0 <= st < len(P.WC_STATUS) else str(st)),
             "opcode": "IBV_WC_" + P.WC_OPCODES.get(wc.opcode, str(wc.opcode)),
             "byte_len": wc.byte_len, "qp_num": wc.qp_num}
        if wc.wc_flags & WC_WITH_IMM:
            d["imm"] = socket.ntohl(wc.imm_data)
        if wc.wc_flags & WC_WITH_INV:
            d["invalidated_rkey"] = wc.imm_data
        if wc.vendor_err:
            d["vendor_err"] = wc.vendor_err
        return d

    # -- memory (MR-CONF-022) ------------------------------------------------------------
    def cmd_mem_read(self, args: dict) -> dict:
        _, m = self._lookup(self.mrs, "mr", args)
        off = P.get_int(args, "offset", 0, 1 << 62)
        n = P.get_int(args, "len", 0, P.MAX_MEM_IO)
        if off + n > m.length:
            raise P.AgentError("EINVAL", f"offset {off} + len {n} is past the MR's {m.length} bytes")
        return {"hex": m.mr.read(n, off).hex() if n else ""}

    def cmd_mem_write(self, args: dict) -> None:
        _, m = self._lookup(self.mrs, "mr", args)
        off = P.get_int(args, "offset", 0, 1 << 62)
        data = P.get_bytes(args, "hex")
        if off + len(data) > m.length:
            raise P.AgentError("EINVAL", f"offset {off} + {len(data)} bytes is past the MR's {m.length} bytes")
        if data:
            m.mr.write(data, len(data), off)

    # -- counters and knobs ----------------------------------------------------------------
    def cmd_get_counters(self, args: dict) -> dict:
        if args.get("qp") is not None:
            self._lookup(self.qps, "qp", args)
            raise P.AgentError("ENOTSUP", "per-QP counters: rdma-core reports the port's counters only "
                                        "(get_counters without qp)")
        return {"counters": self.dev.counters()}

    def cmd_set_param(self, args: dict) -> None:
        name = P.get(args, "name")
        if name not in PARAMS:
            raise P.AgentError("ENOTSUP", f"parameter {name!r}: this agent sets {sorted(PARAMS)} (what the address "
                                        "vector of a verbs QP carries)")
        _, lo, hi = PARAMS[name]
        self.params[name] = P.get_int(args, "value", lo, hi)
        self.params_set.add(name)

    def _cm(self, args: dict):
        raise P.AgentError("ENOTSUP", "connection set-up (cm_*) is not offered by the rdma-core agent; "
                                    "connect QPs with modify_qp")

    cmd_cm_listen = cmd_cm_connect = cmd_cm_wait = _cm


def _close_all(objs) -> None:
    for o in objs:
        o.close()


# ---- TCP server ----------------------------------------------------------------------------
class AgentServer(P.AgentServer):
    """The listener (MR-CONF-013): one session (Agent) per connection, each on its thread (libibverbs is
    thread-safe; sessions share only the device context)."""

    log = log

    def __init__(self, dev: Device, host: str, port: int = P.DEFAULT_PORT) -> None:
        self.dev = dev
        super().__init__(host, port)

    def new_session(self) -> Agent:
        return Agent(self.dev)


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pyverbs_agent.py",
        description="MetaRoCE test agent (spec 9.4) for an rdma-core device, on pyverbs: serves the upper "
                    "tester on TCP.  Off unless started; listens only on --listen (MR-SEC-027).",
        epilog="example (Soft-RoCE VM): python3 pyverbs_agent.py --dev rxe0 --gid-index 1 --listen 10.77.0.2")
    p.add_argument("--dev", help="RDMA device (ibv_devices; default: the first one)")
    p.add_argument("--ib-port", type=int, default=1, help="device port (default %(default)s)")
    p.add_argument("--gid-index", type=int, help="RoCEv2 GID index (default: the first IPv4-mapped RoCEv2 GID)")
    p.add_argument("--listen", default="127.0.0.1", help="address to bind (default %(default)s)")
    p.add_argument("--port", type=int, default=P.DEFAULT_PORT, help="TCP port (default %(default)s)")
    p.add_argument("--timer-granularity-us", type=int,
                   help="claimed timer granularity G (default: 1/HZ for rxe, else 1000)")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        dev = Device(a.dev, a.ib_port, a.gid_index, a.timer_granularity_us)
    except ImportError as e:
        print(f"pyverbs agent: pyverbs is not installed ({e}); apt-get install python3-pyverbs", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"pyverbs agent: cannot open the device: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    try:
        srv = AgentServer(dev, a.listen, a.port)
    except OSError as e:
        print(f"pyverbs agent: cannot listen on {a.listen}:{a.port}: {e}", file=sys.stderr)
        return 1
    log.info("agent on %s:%d for %s port %d GID[%d] %s (%s, %s), max_inline %d, G %d us; ready in %.1f s",
             *srv.address, dev.name, dev.port, dev.gid_index, dev.ip, dev.netdev, dev.mac, dev.max_inline,
             dev.timer_granularity_us, time.monotonic() - _T0)
    print(f"AGENT-READY {srv.address[0]}:{srv.address[1]}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
