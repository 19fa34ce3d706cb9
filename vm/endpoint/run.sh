#!/bin/bash
# vm/endpoint/run.sh - MetaRoCE on a stock distribution kernel and a real NIC driver: Debian 12's own
# kernel (6.1) in a QEMU VM whose virtio-net NIC has 4 queue pairs, the project installed inside from
# its wheel by `make install`, metaroced serving every RX queue with driver-mode XDP, and the host
# (this machine, kernel 6.18) as the peer on the multi-queue tap.  `make vm-endpoint` runs it.
#
#   netns mrpeer<ID> (10.78.<ID>.2)  --veth--  netns rxeh<ID>: router  --tap, 4 queues--  guest eth0 (virtio-net,
#     checkout's `metaroce perf --no-daemon`        (10.78.<ID>.1, 10.77.<ID>.1)           4 channels, 10.77.<ID>.2):
#                                                                                          installed metaroced + perf
# The host's peer sits behind a router, as operators' hosts do, and that is what spreads the traffic: the
# router's transmit to the multi-queue tap picks a queue per flow hash (UDP ports included), and QEMU
# hands queue i's frames to the NIC's RX queue i -- RSS, as a NIC does it.  (An AF_XDP sender on the
# tap itself would pin everything to the queue its socket is bound to.)
#
# Steps (each result lands in $RXEVM_DIR/endpoint/, the summary in report.txt):
#   1. the VM image, which has the endpoint's runtime packages (vm/rxe/build.sh)
#   2. the wheel and a wheelhouse of its [daemon] dependencies (make wheelhouse): the guest has no network
#   3. numba's cache for a generic x86-64 CPU, warmed here: compiling under TCG takes about an hour
#      (Python runs ~12x slower in this VM); the guest runs with NUMBA_CPU_NAME=generic and reads it
#   4. the VM: -q 4 (multi-queue tap and NIC), -R (no Soft-RoCE on eth0)
#   5. in the guest: `make install WHEELHOUSE=...` from an install kit (Makefile, scripts/, daemon/),
#      then metaroced -i eth0 (every RX queue), `metaroced --version`, `metaroce dev show`
#   6. write-bw, read-bw and send-bw, 8 QPs each (NQP), compat, through the guest's metaroced, each side
#      verifying the other's bytes; `metaroce qp list` from the install while QPs are up
#   7. native through the same metaroced (multipath spraying varies the UDP source port: one QP's
#      packets meet every queue)
#   8. checks: every queue received frames, no NO_XSK drop, all verified, XDP in driver mode
# Env: RXEVM_DIR (default /tmp/rxevm, the image vm/rxe builds), VM_ID (default 7), VM_QUEUES (4), NQP (QPs per compat test, 8), ITERS (per QP, 150),
#      KEEP_VM=1 leaves the VM running (vm/rxe/down.sh -i ID stops it).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export RXEVM_DIR=${RXEVM_DIR:-/tmp/rxevm}
ID=${VM_ID:-7}; Q=${VM_QUEUES:-4}; ITERS=${ITERS:-150}
PY=${PY:-$ROOT/.venv/bin/python}
OUT=$RXEVM_DIR/endpoint; RUN=$RXEVM_DIR/run/$ID; SHARE=$RUN/share
NS=rxeh$ID; VM_IP=10.77.$ID.2
PEER_NS=mrpeer$ID; PEER_IF=mrp$ID; RTR_IF=mrr$ID; PEER_IP=10.78.$ID.2; RTR_IP=10.78.$ID.1; NQP=${NQP:-8}
VMX=("$ROOT/vm/rxe/vmexec.sh" -i "$ID")

log() { echo "[vm-endpoint $(date +%T)] $*"; }
die() { echo "[vm-endpoint] FAILED: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root"
[ -x "$PY" ] || die "no $PY: run make setup first"
mkdir -p "$OUT"; rm -f "$OUT"/*.json "$OUT"/*.txt

trap 'echo "[vm-endpoint] FAILED at line $LINENO: $BASH_COMMAND" >&2' ERR
cleanup() {
    [ "${KEEP_VM:-0}" = 1 ] && return
    "$ROOT/vm/rxe/down.sh" -i "$ID" >/dev/null 2>&1 || true
    ip netns del "$PEER_NS" 2>/dev/null || true
}
trap cleanup EXIT

# every command in the guest: numba's code for a generic x86-64, from the cache warmed here (step 3)
GENV="export NUMBA_CPU_NAME=generic NUMBA_CACHE_DIR=/var/cache/metaroce/numba;"
G() { "${VMX[@]}" -t "${TMO:-900}" -- "$GENV $*"; }
GB() { "${VMX[@]}" -b -- "$GENV $*"; }

if [ "${REUSE_VM:-0}" = 1 ]; then      # a VM left by KEEP_VM=1, installed, metaroced serving: steps 6-8 only
    log "REUSE_VM=1: VM $ID as a KEEP_VM=1 run left it"
    DJOB=""
    for f in "$SHARE"/queue/*.run; do
        grep -q "exec metaroced" "$f" && [ ! -e "${f%.run}.rc" ] && DJOB=$(basename "${f%.run}")
    done
    [ -n "$DJOB" ] || die "REUSE_VM=1: no metaroced running in VM $ID"
    ip netns list | grep -qw "$PEER_NS" || die "REUSE_VM=1: no netns $PEER_NS"
    G "uname -r; ethtool -l eth0 | tail -n 4; ethtool -i eth0 | head -n 2" > "$OUT/guest-nic.txt"
    G "metaroced --version; metaroce --version" > "$OUT/versions.txt"
    G "metaroce dev show eth0 -j" > "$OUT/dev-show.json"
    G "metaroce dev show eth0" > "$OUT/dev-show.txt"
else
# 1. image
    log "1. VM image (Debian 12, kernel 6.1, endpoint packages)"
    "$ROOT/vm/rxe/build.sh" > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; die "image build"; }
    KVER=$(cat "$RXEVM_DIR/boot/KVER")
    
    # 2. wheel + wheelhouse
    log "2. wheel and wheelhouse"
    make -C "$ROOT" --no-print-directory wheelhouse DIST="$RXEVM_DIR/dist" > "$OUT/wheel.log" 2>&1 \
        || { tail -20 "$OUT/wheel.log"; die "make wheelhouse"; }
    
    # 3. numba cache for a generic x86-64
    log "3. numba cache for NUMBA_CPU_NAME=generic (here, not under TCG)"
    T=$(date +%s)
    NUMBA_CPU_NAME=generic NUMBA_CACHE_DIR="$RXEVM_DIR/numba-generic" "$PY" -m metaroce_xdp.cli warmup -q \
        > "$OUT/warmup-host.log" 2>&1 || { tail -20 "$OUT/warmup-host.log"; die "warmup"; }
    log "   warm in $(( $(date +%s) - T )) s"
    
    # 4. VM
    log "4. boot: $Q queue pairs, no Soft-RoCE"
    "$ROOT/vm/rxe/down.sh" -i "$ID" >/dev/null 2>&1 || true
    "$ROOT/vm/rxe/up.sh" -i "$ID" -q "$Q" -R -k -m 2048 > "$OUT/up.log" 2>&1 || { cat "$OUT/up.log"; die "VM boot"; }
    tail -1 "$OUT/up.log"
    # the install kit: what `make install` reads from a checkout, and the wheelhouse
    mkdir -p "$SHARE/kit/scripts"
    cp "$ROOT/Makefile" "$SHARE/kit/"; cp "$ROOT/scripts/setup.sh" "$SHARE/kit/scripts/"; cp -r "$ROOT/daemon" "$SHARE/kit/"
    cp -r "$RXEVM_DIR/dist/wheelhouse" "$SHARE/wheelhouse"
    cp -r "$RXEVM_DIR/numba-generic" "$SHARE/numba"
    # the peer behind the router (rxeh<ID> forwards between its veth and the tap)
    ip netns del "$PEER_NS" 2>/dev/null || true
    ip netns add "$PEER_NS"
    ip link add "$PEER_IF" netns "$PEER_NS" type veth peer name "$RTR_IF" netns "$NS"
    ip -n "$PEER_NS" link set lo up
    ip -n "$PEER_NS" addr add "$PEER_IP/24" dev "$PEER_IF"; ip -n "$PEER_NS" link set "$PEER_IF" up
    ip -n "$PEER_NS" route add default via "$RTR_IP"
    ip -n "$NS" addr add "$RTR_IP/24" dev "$RTR_IF"; ip -n "$NS" link set "$RTR_IF" up
    ip netns exec "$NS" sysctl -qw net.ipv4.ip_forward=1
    G "ip route add 10.78.$ID.0/24 via 10.77.$ID.1"
    
    # 5. install + start
    log "5. guest: make install from the wheelhouse"
    G "uname -r; ethtool -l eth0 | tail -n 4; ethtool -i eth0 | head -n 2" | tee "$OUT/guest-nic.txt"
    G "set -e; mkdir -p /var/cache/metaroce; cp -r /mnt/host/numba /var/cache/metaroce/numba
       cd /mnt/host/kit; T=\$(date +%s)
       make install WHEELHOUSE=/mnt/host/wheelhouse
       echo \"install took \$(( \$(date +%s) - T )) s\"" > "$OUT/install.txt" 2>&1 \
        || { tail -30 "$OUT/install.txt"; die "make install in the guest"; }
    tail -3 "$OUT/install.txt"
    G "metaroced --version; metaroce --version; /opt/metaroce/bin/python -c 'import metaroce_xdp; print(metaroce_xdp.__file__)'" \
        | tee "$OUT/versions.txt"
    DJOB=$(GB "exec metaroced -c /etc/metaroce/metaroced.toml -i eth0 --socket-group ''")
    for _ in $(seq 600); do
        grep -q "ready in" "$SHARE/queue/$DJOB.out" 2>/dev/null && break
        [ -e "$SHARE/queue/$DJOB.rc" ] && { cat "$SHARE/queue/$DJOB.out"; die "metaroced exited"; }
        sleep 1
    done
    grep -q "ready in" "$SHARE/queue/$DJOB.out" || { cat "$SHARE/queue/$DJOB.out"; die "metaroced did not start"; }
    log "   metaroced up: $(grep -m1 "ready in" "$SHARE/queue/$DJOB.out")"
    G "metaroce dev show eth0 -j" > "$OUT/dev-show.json"
    G "metaroce dev show eth0" > "$OUT/dev-show.txt"
    
fi

# 6/7. perf: guest server, host client
perf() {   # NAME TEST GUEST_ARGS HOST_ARGS
    local name=$1 test=$2 gargs=$3 hargs=$4 job rc=0
    log "   $name"
    job=$(GB "exec metaroce perf $test -d eth0 -j $gargs")
    for _ in $(seq 300); do
        grep -q "Waiting for client" "$SHARE/queue/$job.out" 2>/dev/null && break
        [ -e "$SHARE/queue/$job.rc" ] && break
        sleep 1
    done
    ip netns exec "$PEER_NS" "$PY" -m metaroce_xdp.cli perf "$test" -d "$PEER_IF" "$VM_IP" -j --no-daemon \
        --timeout 120 $hargs > "$OUT/$name-host.json" 2> "$OUT/$name-host.err" || rc=$?
    "${VMX[@]}" -w "$job" -t 300 > "$OUT/$name-guest.txt" 2>&1 || rc=$((rc ? rc : 100))
    if [ $rc != 0 ]; then                 # recorded for check.py; the other tests still run
        echo "rc $rc" > "$OUT/$name.failed"
        log "   $name FAILED (rc $rc): $(tail -n 1 "$OUT/$name-host.err")"
        "${VMX[@]}" -k "$job" > /dev/null 2>&1 || true
    fi
}
log "6. compat through the guest's metaroced ($NQP QPs, verified both ways)"
perf write-bw write-bw "" "-q $NQP -n $ITERS -s 65536"
# a longer write (2 QPs x 3000 x 64 KiB), and `metaroce qp list` from the install while it runs
log "   long-write-bw, with qp list"
job=$(GB "exec metaroce perf write-bw -d eth0 -j")
for _ in $(seq 300); do grep -q "Waiting for client" "$SHARE/queue/$job.out" 2>/dev/null && break; sleep 1; done
ip netns exec "$PEER_NS" "$PY" -m metaroce_xdp.cli perf write-bw -d "$PEER_IF" "$VM_IP" -j --no-daemon -q 2 \
    -n 3000 > "$OUT/long-write-bw-host.json" 2> "$OUT/long-write-bw-host.err" &
HP=$!
for _ in $(seq 20); do              # each `metaroce qp list` takes seconds to start under TCG
    G "metaroce qp list -j" > "$OUT/qp-list.json" 2>&1 || true
    grep -q '"RTS"' "$OUT/qp-list.json" && break
    sleep 1
done
G "metaroce qp list -j" > "$OUT/qp-list-2.json" 2>&1 || true
rc=0; wait $HP || rc=$?
"${VMX[@]}" -w "$job" -t 300 > "$OUT/long-write-bw-guest.txt" 2>&1 || rc=$((rc ? rc : 100))
if [ $rc != 0 ]; then
    echo "rc $rc" > "$OUT/long-write-bw.failed"
    log "   long-write-bw FAILED (rc $rc): $(tail -n 1 "$OUT/long-write-bw-host.err")"
    "${VMX[@]}" -k "$job" > /dev/null 2>&1 || true
fi
perf read-bw read-bw "" "-q $NQP -n $ITERS -s 65536"
perf send-bw send-bw "" "-q $NQP -n $ITERS -s 65536"
log "7. native through the guest's metaroced (one QP sprayed over the paths' UDP source ports)"
perf native-write-bw write-bw "--profile native" "--profile native -n $ITERS -s 65536"
G "metaroce stat -j" > "$OUT/stat-daemon.json"
"${VMX[@]}" -k "$DJOB" > /dev/null
"${VMX[@]}" -w "$DJOB" -t 60 > "$OUT/metaroced.log" 2>&1 || true

# 8. checks
log "8. checks"
trap - ERR
rc=0; "$PY" "$HERE/check.py" "$OUT" "$Q" > "$OUT/report.txt" || rc=$?
cat "$OUT/report.txt"
exit "$rc"
