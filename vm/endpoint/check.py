"""The verdict of vm/endpoint/run.sh, from the files it left in OUT (stdlib only).

    python3 check.py OUT QUEUES

Prints one line per check (`ok` or `FAIL`), then `RESULT: PASS` or `RESULT: FAIL`, and exits 0 or 1."""
import json
import pathlib
import sys


def main() -> int:
    out, nq = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    ok = True

    def check(cond, what: str) -> None:
        nonlocal ok
        print(("ok   " if cond else "FAIL ") + what)
        ok = ok and bool(cond)

    def load(name: str) -> dict:
        txt = (out / name).read_text(errors="replace")
        objs = [json.loads(line) for line in txt.splitlines() if line.startswith("{")]
        if not objs:
            try:
                return json.loads(txt)
            except ValueError:
                raise SystemExit(f"FAIL {name}: no JSON in {txt[-500:]!r}") from None
        return objs[-1]

    print("guest:", " ".join((out / "guest-nic.txt").read_text().split()))
    print("versions:", " | ".join((out / "versions.txt").read_text().splitlines()[:2]))
    dev = load("dev-show.json")
    d = dev["devices"][0] if "devices" in dev else dev
    f = d.get("features", {})
    print("features:", json.dumps(f, sort_keys=True))
    check(f.get("kernel", "").startswith("6.1."), f"Debian 12's kernel: {f.get('kernel')}")
    check(d.get("queues") == list(range(nq)), f"metaroced serves RX queues {d.get('queues')} of {nq}")
    check(f.get("xdp_mode") == "drv", f"XDP attached in driver mode (virtio_net): {f.get('xdp_mode')}"
          + (f", native refused: {f['xdp_native_refused']}" if f.get("xdp_native_refused") else ""))
    for name in ("write-bw", "long-write-bw", "read-bw", "send-bw", "native-write-bw"):
        if (out / f"{name}.failed").exists() or not (out / f"{name}-host.json").exists():
            err = (out / f"{name}-host.err").read_text(errors="replace").strip().splitlines()[-1:] \
                if (out / f"{name}-host.err").exists() else ["not run"]
            check(False, f"{name}: {' '.join(err)}")
            continue
        r = load(f"{name}-host.json")
        v = [r.get("verified"), r.get("peer_verified")]
        check(all(x is not False for x in v) and any(x is True for x in v),
              f"{name}: verified {v}, {r.get('qps', 1)} QP(s), profile {r.get('profile')}, "
              f"{r.get('bytes', 0)} bytes, {r.get('gbps', 0):.3f} Gbit/s")
    ql = load("qp-list.json")
    rts = [q for q in ql.get("qps", []) if q.get("state") == "RTS"]
    check(rts, f"`metaroce qp list` from the install shows {len(rts)} QP(s) in RTS while a write runs")
    st = load("stat-daemon.json")
    c = st["devices"][0]["counters"]
    per_q = {q["queue"]: q["rx"] for q in c["rx_queues"]}
    print("frames received per RX queue (all tests, metaroced):", per_q)
    check(len(per_q) == nq and all(v > 0 for v in per_q.values()), "every RX queue received MetaRoCE frames")
    drops = {k: v for k, v in c.get("xdp_drops", {}).items() if v}
    check(not drops.get("NO_XSK"), f"no NO_XSK drop (the XDP program's drops: {drops or 'none'})")
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
