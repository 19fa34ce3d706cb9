#!/bin/bash
# MetaRoCE set-up for a fresh Debian 12 machine.  Idempotent: each step checks
# first and only acts on what is missing.  Called by `make setup`; `setup.sh --runtime`
# (`make install`) does steps 1-3 with the runtime packages only, and the smoke check with
# the system python.
#
#   1. Debian packages: the runtime's (python3-bpfcc, iproute2, python3-venv, libdeflate0, and
#      python3-setuptools/-wheel, which build the wheel `make install` installs from a checkout) and,
#      unless --runtime, the development tools' (bpftool tshark qperf iperf3 tcpdump ethtool, and
#      systemd for `systemd-analyze verify` of the metaroced unit: PID 1 need not be systemd)
#   2. kernel headers for BCC: only when /lib/modules/$(uname -r)/build is absent,
#      install linux-headers-<arch> (amd64, arm64, ...: dpkg's architecture) and link build/
#      and source/ to it
#   3. bpffs mounted at /sys/fs/bpf
#   4. a venv from /usr/bin/python3 --system-site-packages (so `import bcc` works)
#      with this package, its daemon extra and its dev extras installed (pytest, hypothesis, and
#      matplotlib for `make bench`'s plots)
#   5. a smoke check: BCC compiles and loads an XDP program
#   6. `metaroce warmup`: the data path's numba functions compiled into numba's on-disk
#      cache, so the first endpoint does not compile while its QPs are live; beside it the same
#      with NUMBA_BOUNDSCHECK=1 into .cache/numba-boundscheck (the bounds-checked fuzz pass)
set -euo pipefail

VENV="${VENV:-.venv}"
RUNTIME_PKGS="python3-bpfcc iproute2 python3-venv python3-pip python3-setuptools python3-wheel libdeflate0"
DEV_PKGS="bpftool tshark qperf iperf3 tcpdump ethtool systemd"
RUNTIME_ONLY=0
[ "${1:-}" = "--runtime" ] && RUNTIME_ONLY=1
PKGS="$RUNTIME_PKGS"
[ "$RUNTIME_ONLY" -eq 1 ] || PKGS="$PKGS $DEV_PKGS"

step() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die()  { printf '\033[31m[setup] error:\033[0m %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (BPF, XDP and network namespaces need it); try: sudo make setup"
command -v apt-get >/dev/null || die "apt-get not found: this set-up targets Debian 12"
[ -x /usr/bin/python3 ] || die "/usr/bin/python3 missing: install Debian's python3"

APT_UPDATED=0
apt_install() {
    if [ "$APT_UPDATED" -eq 0 ]; then
        step "apt-get update"
        apt-get update -qq || die "apt-get update failed (network or sources.list?)"
        APT_UPDATED=1
    fi
    step "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null \
        || die "apt-get install $* failed"
}

# 1. Debian packages
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    apt_install $missing
else
    step "Debian packages present"
fi

# 2. kernel headers where BCC looks for them
KREL="$(uname -r)"
KDIR="/lib/modules/$KREL"
if [ -e "$KDIR/build/include" ] || [ -e "$KDIR/build/Makefile" ]; then
    step "kernel headers for $KREL present"
else
    ARCH="$(dpkg --print-architecture)"          # amd64, arm64, ...: Debian's headers package per architecture
    if ! ls -d /usr/src/linux-headers-*-"$ARCH" >/dev/null 2>&1; then
        apt_install "linux-headers-$ARCH"
    fi
    HDR="$(ls -d /usr/src/linux-headers-*-"$ARCH" | sort -V | tail -n1)"
    COMMON="${HDR%-"$ARCH"}-common"
    [ -d "$HDR" ] || die "no /usr/src/linux-headers-*-$ARCH after installing linux-headers-$ARCH"
    step "linking $KDIR/{build,source} -> $HDR (running kernel $KREL has no headers)"
    mkdir -p "$KDIR"
    ln -sfn "$HDR" "$KDIR/build"
    if [ -d "$COMMON" ]; then ln -sfn "$COMMON" "$KDIR/source"; else ln -sfn "$HDR" "$KDIR/source"; fi
fi

# 3. bpffs
if mountpoint -q /sys/fs/bpf 2>/dev/null; then
    step "bpffs mounted at /sys/fs/bpf"
else
    step "mounting bpffs at /sys/fs/bpf"
    mkdir -p /sys/fs/bpf
    mount -t bpf bpf /sys/fs/bpf || die "cannot mount bpffs at /sys/fs/bpf"
fi

if [ "$RUNTIME_ONLY" -eq 1 ]; then
    /usr/bin/python3 - <<'PY' || die "BCC cannot compile/load an XDP program: check kernel headers and BPF support"
import bcc
b = bcc.BPF(text="int xdp_ok(struct xdp_md *ctx) { return XDP_PASS; }")
b.load_func("xdp_ok", bcc.BPF.XDP)
PY
    step "ok: the runtime's packages, kernel headers and bpffs; BCC compiles and loads XDP programs"
    exit 0
fi

# 4. venv
# (a venv without pip is one whose creation was interrupted: made anew)
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    step "venv $VENV is incomplete (no pip): making it anew"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    step "creating venv $VENV from /usr/bin/python3 (--system-site-packages, for bcc)"
    /usr/bin/python3 -m venv --system-site-packages "$VENV" || die "venv creation failed"
fi
STAMP="$VENV/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -e "$STAMP" ]; then
    step "installing metaroce-xdp with its daemon and dev extras into $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install -q -e '.[daemon,dev]' || die "pip install -e .[daemon,dev] failed"
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
else
    step "python package installed in $VENV"
fi

# 5. smoke check
"$VENV/bin/python" - <<'PY' || die "BCC cannot compile/load an XDP program: check kernel headers and BPF support"
import bcc
b = bcc.BPF(text="int xdp_ok(struct xdp_md *ctx) { return XDP_PASS; }")
b.load_func("xdp_ok", bcc.BPF.XDP)
PY
step "ok: BCC compiles and loads XDP programs"

# 6. numba data path compiled ahead (a compile on a live QP outlasts the peer's ACK timeout)
step "compiling the data path into numba's cache (metaroce warmup; 3-4 minutes when cold on 2 CPUs, seconds when warm)"
# ... and, on the other CPU meanwhile (numba compiles on one), the same code with numba's bounds checking into a
# cache of its own (.cache/numba-boundscheck: the flag is not in numba's cache key), for the bounds-checked
# packet fuzz of `make test` and `make fuzz` (docs/fuzzing.md, "Bounds checking")
BC_CACHE="$(pwd)/.cache/numba-boundscheck"
mkdir -p "$BC_CACHE"
NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR="$BC_CACHE" "$VENV/bin/python" -m metaroce_xdp.cli warmup -q \
    > "$BC_CACHE/warmup.log" 2>&1 &
BC_PID=$!
"$VENV/bin/python" -m metaroce_xdp.cli warmup -q || { kill "$BC_PID" 2>/dev/null; die "metaroce warmup failed: see the error above"; }
wait "$BC_PID" || die "the bounds-checked warmup failed: see $BC_CACHE/warmup.log"
tail -n 1 "$BC_CACHE/warmup.log" | sed 's/^/  bounds-checked: /'
