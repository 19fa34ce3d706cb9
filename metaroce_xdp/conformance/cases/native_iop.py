"""Native-to-native transfer under loss, both ways, against the LT's own scripted native peer (issue 21,
09 9.7 MR-CONF-030/032 in miniature).

The LT plays a second, independently written native endpoint: as the responder it takes the IUT's NATIVE_WRITE
packets out of order, "loses" a seeded tenth of their first transmissions, places the rest by NETH offset and
answers with ACK-type NATIVE_SACKs it builds from its own count of what arrived (native_packets, from the spec);
as the requester it sends a NATIVE_WRITE and a NATIVE_SEND message with a tenth of their first transmissions
withheld and retransmits exactly what the IUT's SACKs report missing.  Both ways the data placed is compared byte
for byte with the data sent (MR-CONF-030) and every completion must be IBV_WC_SUCCESS.  The seed is in the
verdict's detail, so a failing run can be replayed.
"""
from __future__ import annotations

import random
import secrets
import time

from .. import native_packets as N
from .. import packets as P
from ..registry import case
from ._native import WC_OK, connect_native, is_req, is_sack, need, nv, post, summ, wr

LOSS = 0.10                 # share of first transmissions the LT loses, each way
STALL = 0.25                # s: the LT's own retransmission timer as requester when no SACK comes
IUT_REACT = 2e-3            # s: what the IUT may take to act on a SACK the LT sent (its receive path, one round)
SIZE_A = 48 << 10           # IUT -> LT: one NATIVE_WRITE of 48 packets at path MTU 1024
SIZE_W, SIZE_S = 32 << 10, 16 << 10       # LT -> IUT: a NATIVE_WRITE and a NATIVE_SEND
OFF_W, OFF_S = 64 << 10, 96 << 10         # where they land in the IUT's MR (the first 48 KiB are A's source)


def _lost(rng: random.Random, n: int) -> set[int]:
    """Indexes of first transmissions to lose: a tenth, at least one inside and the last (a tail loss)."""
    k = max(2, round(LOSS * n))
    return set(rng.sample(range(1, n - 1), k - 1)) | {n - 1}


def _iut_to_lt(t, c, rng: random.Random, deadline: float) -> dict:
    """The IUT writes SIZE_A bytes to the LT, which loses some first transmissions and SACKs what it has."""
    n = c.npkts(SIZE_A)
    p0 = c.iut_psn
    lost = _lost(rng, n)
    buf = bytearray(SIZE_A)
    got: set[int] = set()
    first: dict[int, N.NativeView] = {}
    reported_at: dict[int, float] = {}       # index -> capture time of the first SACK that reported it
    spurious, unlike, sacks = [], [], 0
    msn0 = c.lt_msn
    mark = post(c, wr(c, "RDMA_WRITE", SIZE_A, wr_id=0xA1))
    after = mark
    done_at = None
    while time.monotonic() < deadline:
        fs = c.t.lt.collect(lambda f: c.is_mine(f) and is_req(f), 0.02, after=after, until=lambda fs: bool(fs))
        if not fs:
            if done_at is not None and time.monotonic() - done_at > 0.05:
                break
            continue
        after = max(f.num for f in fs)
        trig = None
        for f in fs:
            v = nv(f)
            i = (v.psn - p0) & 0xFFFFFF
            if i >= n or v.neth is None:
                continue
            if i in first:                                        # a retransmission
                o = first[i]
                if i in reported_at and f.ts > reported_at[i] + IUT_REACT:
                    spurious.append(f)                            # MR-SACK-023: it was reported received
                if (v.payload != o.payload or int(v.neth.offset) != int(o.neth.offset)
                        or int(v.neth.msn) != int(o.neth.msn) or int(v.neth.msg_len) != int(o.neth.msg_len)
                        or (v.reth is None) != (o.reth is None)
                        or (v.reth is not None and bytes(v.reth) != bytes(o.reth)) or not v.neth.retx):
                    unlike.append(f)                              # MR-SACK-024
            else:
                first[i] = v
                if i in lost:
                    continue                                      # the LT "loses" this one
            if i not in got:
                off = int(v.neth.offset)
                if 0 <= off and off + len(v.payload) <= SIZE_A:
                    buf[off:off + len(v.payload)] = v.payload
                got.add(i)
            trig = f
        if trig is None:
            continue
        cum_i = -1
        while cum_i + 1 in got:
            cum_i += 1
        if cum_i == n - 1 and c.lt_msn == msn0:
            c.lt_msn = (c.lt_msn + 1) & 0xFFFFFF                 # the message is complete (MR-OOO-002)
        cum = P.psn_add(p0, cum_i)
        received = {P.psn_add(p0, j) for j in got if j > cum_i + 1}
        k = nv(trig)
        m = c.send(c.sack(cum, received=received, tsecr=int(k.neth.tsval), echo_sport=k.sport))
        sacks += 1
        ts = c.t.lt.wait(lambda f: f.outgoing, 1.0, after=m)
        now_ts = ts.ts if ts is not None else time.time()
        for j in got:
            reported_at.setdefault(j, now_ts)
        if cum_i == n - 1 and done_at is None:
            done_at = time.monotonic()
    wcs = c.poll(1, max(0.5, deadline - time.monotonic()))
    return {"n": n, "lost": lost, "got": got, "buf": bytes(buf), "spurious": spurious, "unlike": unlike,
            "wcs": wcs, "sacks": sacks, "mark": mark}


def _lt_to_iut(t, c, rng: random.Random, deadline: float) -> dict:
    """The LT writes SIZE_W bytes and sends SIZE_S bytes to the IUT, withholding some first transmissions and
    retransmitting what the IUT's SACKs leave out."""
    data_w, data_s = rng.randbytes(SIZE_W), rng.randbytes(SIZE_S)     # no period: a misplaced packet shows
    c.post_recv(SIZE_S, offset=OFF_S, wr_id=0xB2)
    p0, msn0, rsn0 = c.psn, c.msn, c.rsn
    frames = c.write_msg(data_w, OFF_W) + c.send_msg(data_s)
    retx = (c._msg(N.NATIVE_WRITE, data_w, reth=(c.va + OFF_W, c.rkey, SIZE_W), psn=p0, msn=msn0, retx=True,
                   advance=False)
            + c._msg(N.NATIVE_SEND, data_s, rsn=rsn0, psn=P.psn_add(p0, c.npkts(SIZE_W)), msn=(msn0 + 1) & 0xFFFFFF,
                     retx=True, advance=False))
    n = len(frames)
    lost = _lost(rng, c.npkts(SIZE_W)) | {c.npkts(SIZE_W) + j for j in _lost(rng, c.npkts(SIZE_S))}
    delivered: set[int] = set()
    bad_bits, nretx = [], 0
    mark = c.send(*[f for i, f in enumerate(frames) if i not in lost])
    delivered |= set(range(n)) - lost
    after, last_tx, cum_i = mark, time.monotonic(), -1
    sacked: set[int] = set()
    while time.monotonic() < deadline and cum_i < n - 1:
        fs = c.t.lt.collect(lambda f: c.is_mine(f) and is_sack(f), 0.01, after=after, until=lambda fs: bool(fs))
        if fs:
            after = max(f.num for f in fs)
            for f in fs:
                v = nv(f)
                if v.sack_kind != "ACK":
                    continue
                ci = ((v.psn - p0 + 1) & 0xFFFFFF) - 1              # index of the cumulative PSN, -1: none yet
                rec = {(q - p0) & 0xFFFFFF for q in v.received()}
                if ci >= n or not rec <= delivered or any(j not in delivered for j in range(ci + 1)):
                    bad_bits.append(f)                            # MR-SACK-004: reports what never arrived
                    continue
                cum_i = max(cum_i, ci)
                sacked |= rec
        # the holes below the highest PSN the IUT reports: lost, sent again at once (4.3.5); with none, after
        # STALL without progress everything not reported (the LT's own timeout: a tail loss)
        top = max(sacked | {cum_i})
        missing = [j for j in range(cum_i + 1, top) if j not in sacked and j in lost]
        if not missing and cum_i < n - 1 and time.monotonic() - last_tx > STALL:
            missing = [j for j in range(cum_i + 1, n) if j not in sacked]
        if missing:
            c.send(*[retx[j] for j in missing])
            nretx += len(missing)
            lost -= set(missing)
            delivered |= set(missing)
            last_tx = time.monotonic()
    wcs = c.poll(1, max(0.5, deadline - time.monotonic()))
    got_w = c.mem(OFF_W, SIZE_W)
    got_s = c.mem(OFF_S, SIZE_S)
    return {"n": n, "cum_i": cum_i, "bad_bits": bad_bits, "nretx": nretx, "wcs": wcs, "ok_w": got_w == data_w,
            "ok_s": got_s == data_s, "mark": mark}


@case("TC-IOP-032-a", rules=["MR-SACK-023", "MR-SACK-024", "MR-SACK-004", "MR-SACK-010", "MR-OOO-002"],
      category="IOP", profile="native", timeout=40)
def native_transfer_both_ways_under_loss(t):
    """The IUT and the LT's scripted native peer move data both ways with a tenth of the first transmissions lost
    (the last packet of each message among them): a 48 KiB NATIVE_WRITE from the IUT, which must retransmit only
    PSNs the LT's SACKs left out (a retransmission sent IUT_REACT after the SACK that reported its PSN received
    is one too many), each retransmission identical to the original but for RETX, tsval and AckReq; then a
    32 KiB NATIVE_WRITE and a 16 KiB NATIVE_SEND from the LT, whose SACKs must report only PSNs the LT delivered
    and finally everything.  Every byte placed is compared with what was sent, every completion must succeed."""
    seed = secrets.randbits(32)
    rng = random.Random(seed)
    c = connect_native(t, mr_len=128 << 10, timeout=16)
    src = rng.randbytes(SIZE_A)
    c.mem_write(0, src)
    a = _iut_to_lt(t, c, rng, time.monotonic() + 12)
    wc_ok = bool(a["wcs"]) and a["wcs"][0]["status"] == WC_OK
    lost = sorted(P.psn_add(c.iut_psn, i) for i in a["lost"])
    head = f"seed {seed:#010x}; IUT -> LT: {a['n']} packets, first transmissions lost at {[hex(p) for p in lost]}"
    t.check("MR-SACK-023", not a["spurious"] and len(a["got"]) == a["n"] and wc_ok,
            f"{head}; {a['sacks']} SACKs, {len(a['got'])} of {a['n']} placed, completion "
            f"{a['wcs'][0]['status'] if a['wcs'] else 'none'}; retransmissions of PSNs already reported received: "
            f"{summ(a['spurious'][:4]) or 'none'}", frames=a["spurious"][:4],
            expected="every PSN retransmitted until received, none the LT had reported, the WRITE completes")
    t.check("MR-SACK-024", not a["unlike"], f"{head}; retransmissions unlike their originals: "
            f"{summ(a['unlike'][:4]) or 'none'}", frames=a["unlike"][:4],
            expected="each retransmission identical to the original but for RETX, tsval and AckReq")
    need(len(a["got"]) == a["n"], f"{head}: the IUT's WRITE did not get through, the other direction is not run")
    t.check("MR-OOO-002", a["buf"] == src, f"{head}: the LT's copy of the 48 KiB "
            + ("matches" if a["buf"] == src else "differs"), expected="the IUT's MR bytes, in place")
    b = _lt_to_iut(t, c, rng, time.monotonic() + 12)
    rwc = b["wcs"][0] if b["wcs"] else None
    desc = (f"seed {seed:#010x}; LT -> IUT: {b['n']} packets, {b['nretx']} retransmitted by the LT, the IUT's "
            f"last cumulative index {b['cum_i']}; receive completion {rwc['status'] if rwc else 'none'}"
            + (f" ({rwc.get('byte_len')} B)" if rwc else ""))
    t.check("MR-SACK-004", not b["bad_bits"] and b["cum_i"] == b["n"] - 1,
            f"{desc}; SACKs reporting undelivered PSNs: {summ(b['bad_bits'][:4]) or 'none'}", frames=b["bad_bits"][:4],
            expected="every SACK reports only delivered PSNs; the last one acknowledges all")
    ok = b["ok_w"] and b["ok_s"] and rwc is not None and rwc["status"] == WC_OK and rwc.get("byte_len") == SIZE_S
    t.check("MR-SACK-010", ok, f"{desc}; WRITE bytes {'match' if b['ok_w'] else 'differ'}, SEND bytes "
            f"{'match' if b['ok_s'] else 'differ'}", expected=f"both messages placed whole, the receive WQE completed "
            f"with {SIZE_S} B")
    t.check("MR-OOO-002", ok, desc, expected="each message complete once every PSN arrived, and its data in place")
