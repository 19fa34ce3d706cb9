"""The packet fuzzer: mutated RoCEv2/MetaRoCE packets from a scripted peer (namespace 1, a raw socket) to the
compiled plane (endpoint.py, a child process in namespace 0), while a legitimate QP of the same plane keeps
taking WRITEs from its own scripted peer.

A case is a list of packet specs generated from (seed, case number) by `gen_case`: an opcode (any of the
table, sometimes one that is not), header fields from hostile distributions (PSNs around the expected one
and far from it, VAs around the MR's edges and just below 2^63 and 2^64, DMA lengths up to 2^32 - 1, rkeys
of the target MR, of a local-only MR, of another PD's MR, random ones; SACK bitmaps and native headers on a
compat QP), BTH flags, then byte-level damage (flips, truncation, extension) with the ICRC recomputed
(mostly) or not.  Addresses and keys are symbolic ("victim"+delta), resolved against the endpoint's MRs
when the frame is built (`build`), so a saved case replays against a fresh endpoint.

Checks, after every case: the endpoint process lives (SIGSEGV/SIGBUS are crashes; its stderr has
faulthandler's stack); after every batch: the legitimate QP's WRITE is ACKed within 3 s and its bytes land
(no hang), no canary byte around any MR changed and no byte of the local-only or foreign MR changed (no
write outside a live MR), and the counters account for the frames sent (XDP: events PASSED + STEERED +
*_CONSUMED + DROPPED = frames, DROPPED = sum of drops by reason; the plane: STEERED frames = its rx).
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time

from ..wire import OPCODES, RETH, AETH, AtomicETH, AtomicAckETH, IETH, ImmDt, NETH, SACKETH, RSNETH, encode, decode
from ..wire.hdr import BTH_SIZE, ETH_SIZE, ICRC_SIZE, IP4_SIZE, O_IP4_CSUM, O_IP4_TOTLEN, O_UDP_LEN, UDP_SIZE
from ..wire.icrc import icrc_bytes, icrc_ref
from ..wire.opcodes import Op, OpMask
from ..wire.packet import inet_checksum
from . import known
from .harness import ROOT, batches, die_with_parent, signame
from .store import Finding

PACKET_OUTGOING = 4
E = ETH_SIZE                                             # the frames are untagged IPv4: IPv4 at E,
U = E + IP4_SIZE                                         # UDP at U,
B = U + UDP_SIZE                                         # BTH at B (its first byte is the OpCode)
MAX_FRAME = 1514                                         # the veth's MTU 1500 + Ethernet
MAX_MINIMIZE = 3                                         # crashes of several packets cut down to one, per run
MRS = ("victim", "local", "foreign", "legit")
EVENTS_PARTITION = ("PASSED", "STEERED", "ACK_CONSUMED", "NAK_CONSUMED", "RNR_CONSUMED", "DROPPED", "CNP_CONSUMED",
                    "SACK_CONSUMED")
PLANE_DROPS = ("rx_drop_icrc", "rx_drop_qp", "rx_drop_state", "rx_drop_len", "rx_drop_op", "rx_dup", "rx_oos",
               "rx_rsp_stale", "rx_ghost_rsp", "rx_dup_atomic", "rx_sack_kern_drop")


# ---- generating -------------------------------------------------------------------------------------------
def _va(r: random.Random):
    k = r.randrange(10)
    if k < 4:
        return [r.choice(MRS[:1] * 4 + MRS[1:]), r.choice([0, 1, 8, 4096, 65535, 65536, 65537, -1, -8, -4096,
                                                          65536 - 8, 65536 - 64, 32768, r.randrange(65536)])]
    if k < 7:
        return ["abs", r.choice([(1 << 63) - 1, (1 << 63) - 8, (1 << 63) - 64, (1 << 63) - 4096, (1 << 63) - 65536,
                                 (1 << 64) - 8, (1 << 64) - 4096, 1 << 63, 0, 8, 1 << 47, (1 << 47) - 8])]
    return ["abs", r.getrandbits(64)]


def _len(r: random.Random) -> int:
    return r.choice([0, 1, 8, 64, 1024, 1025, 4096, 65536, 65537, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
                     r.randrange(1 << 17), r.getrandbits(32)])


def _rkey(r: random.Random):
    return r.choice(["victim"] * 5 + ["local", "foreign", "legit", 0, 0xFFFFFFFF, r.getrandbits(32), "victim^1",
                                      "victim+256"])


def _psn(r: random.Random):
    return r.choice([["epsn", 0]] * 4 + [["epsn", r.choice([1, 2, -1, -2, 100, -100, 1 << 22, -(1 << 22),
                                                            (1 << 23) - 1, 1 << 23])], ["abs", r.getrandbits(24)],
                                        ["spsn", r.choice([0, 1, 2, 5, -1, 100])]])


def gen_packet(r: random.Random) -> dict:
    fam = r.choices(["write", "read", "atomic", "send", "resp", "cnp", "native", "any"], [6, 3, 2, 3, 3, 1, 2, 2])[0]
    ops = {"write": [Op.RDMA_WRITE_ONLY, Op.RDMA_WRITE_FIRST, Op.RDMA_WRITE_MIDDLE, Op.RDMA_WRITE_LAST,
                     Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE, Op.RDMA_WRITE_LAST_WITH_IMMEDIATE],
           "read": [Op.RDMA_READ_REQUEST], "atomic": [Op.COMPARE_SWAP, Op.FETCH_ADD],
           "send": [Op.SEND_ONLY, Op.SEND_FIRST, Op.SEND_MIDDLE, Op.SEND_LAST, Op.SEND_ONLY_WITH_IMMEDIATE,
                    Op.SEND_LAST_WITH_IMMEDIATE, Op.SEND_ONLY_WITH_INVALIDATE, Op.SEND_LAST_WITH_INVALIDATE],
           "resp": [Op.ACKNOWLEDGE, Op.ATOMIC_ACKNOWLEDGE, Op.RDMA_READ_RESPONSE_ONLY, Op.RDMA_READ_RESPONSE_FIRST,
                    Op.RDMA_READ_RESPONSE_MIDDLE, Op.RDMA_READ_RESPONSE_LAST],
           "cnp": [Op.CNP],
           "native": [Op.NATIVE_SEND, Op.NATIVE_SEND_IMM, Op.NATIVE_WRITE, Op.NATIVE_WRITE_IMM, Op.NATIVE_READ_REQ,
                      Op.NATIVE_READ_RESP, Op.NATIVE_SACK],
           "any": list(Op)}[fam]
    op = int(r.choice(ops))
    info = OPCODES[op]
    h: dict = {}
    for name in info.headers:
        if name == "reth":
            h[name] = {"va": _va(r), "rkey": _rkey(r), "dma_len": _len(r)}
        elif name == "aeth":
            h[name] = {"syndrome": r.choice([0, 0x1F, 0x20, 0x3F, 0x60, 0x61, 0x62, 0x63, 0x64, 0x65, 0x7F,
                                             r.getrandbits(8)]), "msn": r.getrandbits(24)}
        elif name == "atomiceth":
            h[name] = {"va": _va(r), "rkey": _rkey(r), "swap_add": r.getrandbits(64), "compare": r.getrandbits(64)}
        elif name == "atomicacketh":
            h[name] = {"orig": r.getrandbits(64)}
        elif name == "immdt":
            h[name] = {"imm": r.getrandbits(32)}
        elif name == "ieth":
            h[name] = {"rkey": _rkey(r)}
        elif name == "neth":
            h[name] = {"flags": r.choice([0x80, 0x40, 0xC0, 0x20, 0, 0xFF]), "msn": r.getrandbits(24),
                       "offset": r.choice([0, 4096, (1 << 32) - 1, r.getrandbits(32)]), "msg_len": _len(r),
                       "tsval": r.getrandbits(32)}
        elif name == "rsneth":
            h[name] = {"rsn": r.getrandbits(24)}
        elif name == "sacketh":
            h[name] = {"tsecr": r.getrandbits(32), "credit": r.getrandbits(16), "ce_count": r.getrandbits(16),
                       "echo_sport": r.getrandbits(16), "flags": r.getrandbits(8)}
    spec = {"op": op, "h": h, "psn": _psn(r),
            "dest": r.choices(["victim", "random", "none"], [12, 1, 1])[0],
            "payload": (r.choice([0, 1, 3, 4, 8, 63, 64, 256, 1024, 1025, 1400]) if info.has(OpMask.PAYLOAD) else 0),
            "bth": {k: r.getrandbits(b) for k, b in (("se", 1), ("m", 1), ("tver", 4), ("fecn", 1), ("becn", 1))
                    if r.random() < 0.1},
            "ack_req": r.getrandbits(1), "fill": r.getrandbits(8)}
    if "sacketh" in h:
        spec["sack"] = [r.getrandbits(32) for _ in range(r.choice([0, 1, 2, 8, 32]))]
    if r.random() < 0.05:
        spec["bth"]["pkey"] = r.choice([0, 0x7FFF, 0x8001, r.getrandbits(16)])
    if r.random() < 0.1:
        spec["bth"]["pad"] = r.getrandbits(2)
    if r.random() < 0.08:
        spec["opcode_byte"] = r.choice([0x15, 0x18, 0x1F, 0x20, 0x40, 0x64, 0x80, 0x82, 0xC7, 0xDF, 0xFF])
    dmg = r.random()
    if dmg < 0.15:
        spec["flip"] = [[r.randrange(E, 120), r.getrandbits(8)] for _ in range(r.randrange(1, 4))]
    elif dmg < 0.22:
        spec["truncate"] = r.randrange(U, 90)
    elif dmg < 0.27:
        spec["extend"] = r.choice([1, 3, 4, 60, 900])
    spec["icrc"] = r.choices(["fix", "keep", "bad"], [8, 1, 1])[0]
    spec["fix_len"] = r.random() < 0.8
    return spec


def gen_case(seed: int, case: int) -> list[dict]:
    r = random.Random(f"pkt:{seed}:{case}")
    rn = random.Random(f"pkt-native:{seed}:{case}")        # its own stream: the cases of `r` stay as they were
    n = r.choice([1, 1, 2, 3, 4, 8])
    specs = [to_native(gen_packet(r), rn) for _ in range(n)]
    if known.avoid():
        for s in specs:
            for hn in ("reth", "atomiceth"):
                va = s["h"].get(hn, {}).get("va")
                if va and va[0] == "abs" and known.near_2_63(va[1]):
                    s["h"][hn]["va"] = ["victim", 0]
    return specs


def to_native(spec: dict, rn: random.Random) -> dict:
    """Most native opcodes go to the endpoint's native QP (its SACK, NETH and credit logic), with PSNs around
    its own; the rest stay on the compat victim (WRONG_PROFILE)."""
    if spec["op"] < Op.NATIVE_SEND or rn.random() < 0.2:
        return spec
    kind = "nspsn" if spec["op"] in (Op.NATIVE_SACK, Op.NATIVE_READ_RESP) else "nepsn"
    spec["dest"] = "native"
    spec["psn"] = rn.choice([[kind, 0], [kind, 0], [kind, 1], [kind, -1], [kind, rn.choice([2, 7, 31, 32, 33, 64])],
                             [kind, -rn.randrange(1, 200)], [kind, 1 << 23], ["abs", rn.getrandbits(24)]])
    if "sack" in spec:
        spec["sack"] = [rn.getrandbits(32) for _ in range(rn.choice([0, 1, 2, 4, 8, 32]))]
    return spec


# ---- building ---------------------------------------------------------------------------------------------------
class Wire:
    """What a spec resolves against: the endpoint's MRs and QPNs, the addresses, the PSNs seen."""

    def __init__(self, info: dict, pair) -> None:
        self.info, self.pair = info, pair
        self.epsn = info["psn"]["victim"]                   # the victim's expected PSN, as its ACKs tell
        self.spsn = info["psn"]["victim"] + 100000          # the victim's own requests' first PSN
        self.nepsn = info["psn"].get("native", 0)           # the same for the native QP
        self.nspsn = self.nepsn + 100000

    def val(self, v, what: str) -> int:
        mr = self.info["mr"]
        if isinstance(v, list):
            if v[0] == "abs":
                return v[1] & 0xFFFFFFFFFFFFFFFF
            return (mr[v[0]]["addr"] + v[1]) & 0xFFFFFFFFFFFFFFFF
        if isinstance(v, str):
            if v == "victim^1":
                return mr["victim"]["rkey"] ^ 1
            if v == "victim+256":
                return (mr["victim"]["rkey"] + 256) & 0xFFFFFFFF
            return mr[v]["rkey"]
        return v


def build(spec: dict, w: Wire) -> bytes:
    a, b = w.pair.a, w.pair.b
    op = spec["op"]
    cls = {"reth": RETH, "aeth": AETH, "atomiceth": AtomicETH, "atomicacketh": AtomicAckETH, "immdt": ImmDt,
           "ieth": IETH, "neth": NETH, "rsneth": RSNETH, "sacketh": SACKETH}
    headers = {}
    for name, f in spec["h"].items():
        f = {k: w.val(v, k) for k, v in f.items()}
        if name == "sacketh":
            f["bitmap_words"] = len(spec.get("sack", []))
        headers[name] = cls[name](**f)
    kind, d = spec["psn"]
    psn = (d if kind == "abs" else {"epsn": w.epsn, "spsn": w.spsn, "nepsn": w.nepsn, "nspsn": w.nspsn}[kind] + d) \
        & 0xFFFFFF
    qpn = w.info["qpn"]
    dest = {"victim": qpn["victim"], "native": qpn.get("native", qpn["victim"]), "random": 0xABCDEF,
            "none": 0}[spec["dest"]]
    payload = bytes([spec["fill"]]) * spec["payload"]
    frame = bytearray(encode(op, src_mac=b.mac, dst_mac=a.mac, src_ip=b.ipv4, dst_ip=a.ipv4, sport=0xC0DE,
                             dest_qp=dest, psn=psn, ack_req=spec["ack_req"], headers=headers, payload=payload,
                             sack_bitmap=spec.get("sack", ()), **spec["bth"]))
    if "opcode_byte" in spec:
        frame[B] = spec["opcode_byte"]
    for off, val in spec.get("flip", []):
        if off < len(frame):
            frame[off] ^= val
    if "truncate" in spec:
        frame = frame[:spec["truncate"]]
    if "extend" in spec:
        frame += bytes([spec["fill"]]) * spec["extend"]
    if spec["fix_len"] and len(frame) >= B:
        n3 = len(frame) - E
        frame[E + O_IP4_TOTLEN:E + O_IP4_TOTLEN + 2] = n3.to_bytes(2, "big")
        frame[U + O_UDP_LEN:U + O_UDP_LEN + 2] = (n3 - IP4_SIZE).to_bytes(2, "big")
        frame[E + O_IP4_CSUM:E + O_IP4_CSUM + 2] = b"\0\0"
        frame[E + O_IP4_CSUM:E + O_IP4_CSUM + 2] = inet_checksum(bytes(frame[E:U])).to_bytes(2, "big")
    if spec["icrc"] == "fix" and len(frame) >= B + BTH_SIZE + ICRC_SIZE:
        frame[-4:] = icrc_bytes(icrc_ref(bytes(frame[E:-4]), False))
    elif spec["icrc"] == "bad" and len(frame) > E + 4:
        frame[-1] ^= 0x5A
    return bytes(frame)


def describe(specs: list[dict], w: Wire | None) -> str:
    """One line per packet: opcode, PSN and the placement fields, tagged "near-2^63" (a VA within 2^32 below 2^63
    or 2^64) and "wrap" (va + len beyond 2^63 - 1) -- the shape of finding 2."""
    out = []
    for s in specs:
        name = OPCODES[s["op"]].name
        line = f"{name} dest={s['dest']} psn={s['psn']}"
        for hn in ("reth", "atomiceth"):
            if hn in s["h"]:
                f = s["h"][hn]
                va = w.val(f["va"], "va") if w else f["va"]
                n = f.get("dma_len", 8)
                line += f" {hn} va={hex(va) if isinstance(va, int) else va} len={n} rkey={f['rkey']}"
                if isinstance(va, int):
                    if (1 << 63) - (1 << 32) <= va < (1 << 63) or va >= (1 << 64) - (1 << 32):
                        line += " near-2^63"
                    if va < (1 << 63) <= va + n or va >= 1 << 63:
                        line += " wrap"
        for k in ("opcode_byte", "flip", "truncate", "extend"):
            if k in s:
                line += f" {k}={s[k]}"
        out.append(line)
    return "\n".join(out)


# ---- the target ------------------------------------------------------------------------------------------------
class InprocTarget:
    """The compiled plane in a child process in namespace 0, the scripted peers on namespace 1's raw socket."""

    name = "inproc"

    def __init__(self, prefix: str = "fzp", env: dict | None = None) -> None:
        from ..topo import two_hosts
        self.topo, self.pair = two_hosts(prefix=prefix)
        self.env = env
        with self.topo.enter(self.topo[1]):
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
            self.sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)             # SO_RCVBUFFORCE
            self.sock.bind((self.pair.b.ifname, 3))
            self.swallow = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.swallow.bind((self.pair.b.ipv4, 4791))
        self.sock.setblocking(False)
        self.swallow.setblocking(False)
        self.errpath = f"/tmp/{prefix}-endpoint-{os.getpid()}.err"
        self.p = None
        self.restarts = 0
        self.resets_total = 0
        self.start()

    def start(self) -> None:
        err = open(self.errpath, "w")
        env = dict(os.environ, **(self.env or {}))
        self.p = self.topo.popen(self.topo[0], [sys.executable, "-m", "metaroce_xdp.fuzz.endpoint", *self.endpoint_args(),
                                                self.pair.b.ipv4], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=err, text=True, cwd=str(ROOT), env=env, preexec_fn=die_with_parent)
        err.close()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"endpoint did not start: {open(self.errpath).read()[-3000:]}")
        self.info = json.loads(line)
        self.wire = Wire(self.info, self.pair)
        self.legit_psn = self.info["psn"]["legit"]
        self.legit_img: dict[int, str] = {}
        self.nlegit = 0
        self.resets = 0

    def endpoint_args(self) -> list[str]:
        return ["inproc", self.pair.a.ifname]

    def alive(self, wait: float = 0.0) -> tuple[bool, str]:
        t_end = time.monotonic() + wait
        while self.p.poll() is None and time.monotonic() < t_end:
            time.sleep(0.05)
        if self.p.poll() is None:
            return True, ""
        return False, f"endpoint died: {signame(self.p.returncode)}\n{open(self.errpath).read()[-4000:]}"

    def stderr(self) -> str:
        """The endpoint's stderr so far (an exception in the plane's thread, bounds checking's IndexError)."""
        try:
            with open(self.errpath) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def restart(self) -> None:
        self.resets_total += getattr(self, "resets", 0)
        self.stop()
        self.restarts += 1
        self.start()

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            try:
                self.p.stdin.write('{"cmd": "quit"}\n')
                self.p.stdin.flush()
                self.p.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait(10)
        self.p = None

    def send(self, frames: list[bytes]) -> None:
        for f in frames:
            try:
                self.sock.send(f)
            except OSError:
                pass

    def drain(self) -> list:
        """The endpoint's frames (decoded where they decode); notes the victim's ePSN from its ACKs."""
        out = []
        vq = self.info["peer"]["victim"]
        while True:
            try:
                f, addr = self.sock.recvfrom(1 << 16)
            except BlockingIOError:
                return out
            if addr[2] == PACKET_OUTGOING or len(f) < 42 or f[23] != 17 or f[36:38] != b"\x12\xb7":
                continue
            try:
                p = decode(f, verify_icrc=False)
            except Exception:                               # noqa: BLE001 - the endpoint sent something odd: keep it
                continue
            if p.bth.dest_qp == vq and p.bth.opcode == Op.ACKNOWLEDGE and p.aeth is not None \
                    and p.aeth.syndrome & 0x60 == 0:
                self.wire.epsn = (p.bth.psn + 1) & 0xFFFFFF
            out.append(p)

    def legit_write(self, timeout: float = 3.0) -> str | None:
        """The legitimate peer WRITEs 64 bytes and waits for their ACK."""
        self.nlegit += 1
        off = (self.nlegit * 64) % 32768
        payload = os.urandom(64)
        m = self.info["mr"]["legit"]
        a, b = self.pair.a, self.pair.b
        psn = self.legit_psn
        f = encode(Op.RDMA_WRITE_ONLY, src_mac=b.mac, dst_mac=a.mac, src_ip=b.ipv4, dst_ip=a.ipv4, sport=0xC1DE,
                   dest_qp=self.info["qpn"]["legit"], psn=psn, ack_req=1,
                   headers={"reth": RETH(va=m["addr"] + off, rkey=m["rkey"], dma_len=64)}, payload=payload)
        lq = self.info["peer"]["legit"]
        t_end = time.monotonic() + timeout
        self.send([f])
        while time.monotonic() < t_end:
            for p in self.drain():
                if p.bth.dest_qp == lq and p.bth.opcode == Op.ACKNOWLEDGE and p.bth.psn == psn:
                    if p.aeth.syndrome & 0x60:
                        return f"the legitimate WRITE (psn {psn}) was NAKed: syndrome {p.aeth.syndrome:#x}"
                    self.legit_psn = (psn + 1) & 0xFFFFFF
                    self.legit_img[off] = payload.hex()
                    return None
            time.sleep(0.01)
        return f"the legitimate WRITE (psn {psn}) was not ACKed within {timeout} s"

    def fix(self) -> None:
        """Between cases: the victim QP back to RTS if the last case moved it to ERR."""
        self.check({"cmd": "fix"})

    def check(self, cmd: dict | None = None) -> dict | None:
        """The endpoint's checks and counters; a victim QP in ERR is brought back to RTS (new ePSN)."""
        try:
            self.p.stdin.write(json.dumps(cmd or {"cmd": "check", "legit": sorted(self.legit_img.items())}) + "\n")
            self.p.stdin.flush()
            line = self.p.stdout.readline()
        except OSError:
            return None
        if not line:
            return None
        c = json.loads(line)
        if c.get("resets", 0) != self.resets:
            self.resets = c["resets"]
            self.wire.epsn = c["victim_psn"]
            self.wire.spsn = c["victim_psn"] + 100000
            self.wire.nepsn = c.get("native_psn", 0)
            self.wire.nspsn = self.wire.nepsn + 100000
        return c

    def close(self) -> None:
        self.stop()
        self.sock.close()
        self.swallow.close()
        self.topo.close()
        try:
            os.unlink(self.errpath)
        except OSError:
            pass


class DaemonTarget(InprocTarget):
    """The same endpoint as a client of a metaroced in namespace 0: the packets meet the daemon's plane (dp/serve.py
    around the same loop), "foreign" is a second client's MR, a crash is the daemon's."""

    name = "daemon"

    def __init__(self, prefix: str = "fzd", env: dict | None = None) -> None:
        self.daemon = None
        self.dtmp = None
        super().__init__(prefix, env)

    def endpoint_args(self) -> list[str]:
        return ["daemon", os.path.join(self.dtmp, "A.sock")]

    def start(self) -> None:
        import tempfile
        from pathlib import Path
        if self.dtmp is None:
            self.dtmp = tempfile.mkdtemp(prefix="fzd-")
            os.mkdir(os.path.join(self.dtmp, "bpf"))
            subprocess.run(["mount", "-t", "bpf", "bpf", os.path.join(self.dtmp, "bpf")], check=True)
        sock = os.path.join(self.dtmp, "A.sock")
        conf = os.path.join(self.dtmp, "A.toml")
        Path(conf).write_text(f'interfaces = ["{self.pair.a.ifname}"]\nsocket_path = "{sock}"\nprogress = "sleep"\n'
                              f'bpffs_prefix = "{self.dtmp}/bpf/metaroce"\ndrain_timeout_s = 0.5\n')
        self.dlog = os.path.join(self.dtmp, "A.log")
        err = open(self.dlog, "a")
        env = dict(os.environ, **(self.env or {}))
        self.daemon = self.topo.popen(self.topo[0], [sys.executable, "-m", "metaroce_xdp.daemon.server", "--config",
                                                     conf], stdout=subprocess.PIPE, stderr=err, text=True,
                                      cwd=str(ROOT), env=env, preexec_fn=die_with_parent)
        err.close()
        line = self.daemon.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError(f"metaroced did not start: {open(self.dlog).read()[-3000:]}")
        super().start()

    def alive(self, wait: float = 0.0) -> tuple[bool, str]:
        t_end = time.monotonic() + wait
        while self.daemon.poll() is None and time.monotonic() < t_end:
            time.sleep(0.05)
        if self.daemon.poll() is None:
            ok, why = super().alive()
            return ok, why and why.replace("endpoint died", "the daemon's client (endpoint) died")
        return False, f"metaroced died: {signame(self.daemon.returncode)}\n{open(self.dlog).read()[-4000:]}"

    def stderr(self) -> str:
        try:
            return open(self.dlog).read()[-3000:] + "\n" + super().stderr()[-1000:]
        except OSError:
            return super().stderr()

    def stop(self) -> None:
        super().stop()
        if self.daemon is not None:
            if self.daemon.poll() is None:
                self.daemon.terminate()
                try:
                    self.daemon.wait(15)
                except subprocess.TimeoutExpired:
                    self.daemon.kill()
                    self.daemon.wait(10)
            self.daemon = None

    def close(self) -> None:
        super().close()
        if self.dtmp:
            subprocess.run(["umount", os.path.join(self.dtmp, "bpf")], check=False)
            subprocess.run(["rm", "-rf", self.dtmp], check=False)


# ---- running --------------------------------------------------------------------------------------------------------
def _delta(new: dict, old: dict | None) -> dict:
    return {k: v - (old or {}).get(k, 0) for k, v in new.items() if v - (old or {}).get(k, 0)}


def account(c0: dict, c1: dict, sent: int) -> list[str]:
    """What the counters fail to explain about the frames sent between two checks."""
    ev = _delta(c1["xdp_events"], c0["xdp_events"])
    dr = _delta(c1["xdp_drops"], c0["xdp_drops"])
    st = _delta(c1["stats"], c0["stats"])
    seen = sum(ev.get(k, 0) for k in EVENTS_PARTITION)
    out = []
    if seen < sent:
        out.append(f"XDP accounted for {seen} frames of {sent} sent (events {ev})")
    if ev.get("DROPPED", 0) != sum(dr.values()):
        out.append(f"XDP DROPPED {ev.get('DROPPED', 0)} but drops by reason sum to {sum(dr.values())} ({dr})")
    if ev.get("STEERED", 0) != st.get("rx", 0):
        out.append(f"XDP steered {ev.get('STEERED', 0)} frames to the plane, the plane counted rx {st.get('rx', 0)}")
    return out


def violations(c: dict) -> list[str]:
    out = []
    for k, offs in c["slack"].items():
        out.append(f"canary around the {k} MR changed at MR offsets {offs}")
    for k, n in c["changed"].items():
        out.append(f"{n} bytes of the {k} MR changed (no packet of the fuzzed QP may write it)")
    if c["legit_diff"]:
        out.append(f"the legitimate MR differs from what its peer wrote at offsets {c['legit_diff']}")
    return out


def run(t: InprocTarget, seed: int, cases, batch: int = 4, deadline: float | None = None, minimize: bool = True,
        log=lambda line: print(line, flush=True)) -> tuple[list[Finding], dict]:
    found: list[Finding] = []
    stats = {"target": t.name, "cases": 0, "frames": 0, "crashes": 0, "hangs": 0, "violations": 0,
             "xdp_drops": {}, "plane_drops": {}, "xdp_events": {}, "minimized": 0}
    c0 = t.check()
    for chunk in batches(cases, batch, deadline):
        sent = 0
        crashed = False
        for c in chunk:
            specs = gen_case(seed, c)
            t.drain()
            frames = [build(s, t.wire) for s in specs]
            t.send(frames)
            sent += sum(len(x) <= MAX_FRAME for x in frames)   # the veth drops longer ones before XDP
            stats["cases"] += 1
            stats["frames"] += len(frames)
            time.sleep(0.02)
            ok, why = t.alive(wait=0.1)
            if ok:
                t.fix()
                ok, why = t.alive()
            if not ok:
                where = describe(specs, t.wire)
                culprit = None
                f = Finding("pkt", seed, c, "crash", why.splitlines()[0], where + "\n" + why,
                            {"specs": specs, "frames": [x.hex() for x in frames], "target": t.name})
                if minimize and len(specs) > 1 and stats["minimized"] < MAX_MINIMIZE:
                    stats["minimized"] += 1
                    culprit = minimize_case(t, specs)
                    if culprit is not None:
                        f = Finding("pkt", seed, c, "crash", why.splitlines()[0],
                                    "alone: " + describe([specs[culprit]], t.wire) + "\n" + where + "\n" + why,
                                    {"specs": specs, "culprit": culprit, "frames": [x.hex() for x in frames],
                                     "target": t.name})
                found.append(f)
                stats["crashes"] += 1
                log(f.line())
                t.restart()
                c0 = t.check()
                crashed = True
                sent = 0
        t.drain()
        err = t.legit_write()
        if err:
            ok, why = t.alive(wait=1.0)
            f = Finding("pkt", seed, chunk[-1], "hang" if ok else "crash", err if ok else why.splitlines()[0],
                        describe([s for c in chunk for s in gen_case(seed, c)], t.wire) + "\n" + (why or t.stderr()),
                        {"cases": chunk, "target": t.name})
            found.append(f)
            stats["hangs" if ok else "crashes"] += 1
            log(f.line())
            t.restart()
            c0 = t.check()
            continue
        c1 = t.check()
        if c1 is None:
            continue
        bad = violations(c1)
        if not crashed and c0 is not None:
            bad += account(c0, c1, sent + 1)
        if bad:
            kind = "oob-write" if violations(c1) else "accounting"
            f = Finding("pkt", seed, chunk[-1], kind, bad[0], "\n".join(bad) + "\n" +
                        describe([s for c in chunk for s in gen_case(seed, c)], t.wire), {"cases": chunk,
                                                                                           "target": t.name})
            found.append(f)
            stats["violations"] += 1
            log(f.line())
            if kind == "oob-write":
                t.restart()
                c1 = t.check()
        if c0 is not None and c1 is not None:
            for key, src in (("xdp_drops", "xdp_drops"), ("xdp_events", "xdp_events")):
                for k, v in _delta(c1[src], c0[src]).items():
                    stats[key][k] = stats[key].get(k, 0) + v
            for k, v in _delta({k: c1["stats"].get(k, 0) for k in PLANE_DROPS},
                               {k: c0["stats"].get(k, 0) for k in PLANE_DROPS}).items():
                stats["plane_drops"][k] = stats["plane_drops"].get(k, 0) + v
        c0 = c1
    stats["restarts"] = t.restarts
    stats["victim_resets"] = t.resets_total + t.resets
    return found, stats


def minimize_case(t: InprocTarget, specs: list[dict]) -> int | None:
    """The first packet of the case that crashes a fresh endpoint alone (None: only together)."""
    for k, s in enumerate(specs):
        t.restart()
        t.send([build(s, t.wire)])
        time.sleep(0.2)
        ok, _ = t.alive(wait=0.3)
        if not ok:
            return k
    return None


def boundscheck_env(cache_dir: str) -> dict:
    """The endpoint's environment for a run with numba's bounds checking: an index out of range raises
    IndexError instead of reading or writing past an array.  The compiled code differs, so it has a cache of
    its own (a cold one costs the whole compile of the plane again: docs/fuzzing.md)."""
    return {"NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": os.path.abspath(cache_dir)}


def run_all(seed: int, cases, deadline: float, target: str = "inproc",
            boundscheck: str | None = None) -> tuple[list[Finding], dict]:
    t0 = time.monotonic()
    found: list[Finding] = []
    out: dict = {}
    kinds = {"inproc": [InprocTarget], "daemon": [DaemonTarget], "both": [InprocTarget, DaemonTarget]}[target]
    t_end = deadline
    for i, cls in enumerate(kinds):
        t1 = time.monotonic()
        share = t1 + (t_end - t1) / (len(kinds) - i)              # the time left, split between the targets
        t = cls(env=boundscheck_env(boundscheck) if boundscheck else None)
        try:
            f, st = run(t, seed, cases if cases is not None else range(10 ** 9),
                        deadline=None if cases is not None else share)
        finally:
            t.close()
        st["seconds"] = round(time.monotonic() - t1, 1)
        st["boundscheck"] = bool(boundscheck)
        found += f
        out[cls.name] = st
    out["seconds"] = round(time.monotonic() - t0, 1)
    return found, out


def replay(rec: dict) -> int:
    t = (DaemonTarget if rec["input"].get("target") == "daemon" else InprocTarget)(prefix="fzq")
    try:
        specs = rec["input"].get("specs")
        if specs is None:
            specs = [s for c in rec["input"]["cases"] for s in gen_case(rec["seed"], c)]
        if "culprit" in rec["input"]:
            specs = [specs[rec["input"]["culprit"]]]
        print(describe(specs, t.wire))
        t.send([build(s, t.wire) for s in specs])
        time.sleep(0.5)
        ok, why = t.alive(wait=0.5)
        print("endpoint:", "alive" if ok else why)
        err = t.legit_write() if ok else "endpoint dead"
        c = t.check() if ok else None
        print("legitimate WRITE:", err or "ACKed", "; violations:", violations(c) if c else "-")
        return 0 if ok and not err and not (c and violations(c)) else 1
    finally:
        t.close()
