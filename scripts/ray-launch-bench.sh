#!/usr/bin/env bash
# Ray launch-rate benchmark (docs/BENCHMARKS.md): a 3-node Ray cluster (3 x 8 GPUs, gpuam's
# resources from `gpuam ray-node-args`) in a fresh network namespace, then
# scripts/ray-launch-bench.py. Everything it started is killed by pid and the namespace
# deleted on exit. Needs root. Usage: scripts/ray-launch-bench.sh [TASKS] (default 16).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-16}
bash scripts/ray-setup.sh >/dev/null
gpuam=target/debug/gpuam
[ -x "$gpuam" ] || cargo build -q
ns=ray-bench-$$
tmp=/tmp/raybench-$$
V=$PWD/target/ray-venv/bin
cleanup() {
  for sig in TERM KILL; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -s $sig "$p" 2>/dev/null || true; done
    sleep 3
  done
  ip netns del "$ns" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
mkdir -p "$tmp"
ip netns add "$ns"
ip -n "$ns" link set lo up
export PATH=$V:$PATH RAY_USAGE_STATS_ENABLED=0 RAY_enable_worker_prestart=0
alive() {
  ip netns exec "$ns" "$V/python" -c 'import json,urllib.request,sys
d=json.load(urllib.request.urlopen("http://127.0.0.1:8265/api/v0/nodes?detail=true"))
print(sum(1 for x in d["data"]["result"]["result"] if x["state"]=="ALIVE"))' 2>/dev/null || echo 0
}
i=0
for h in n1 n2 n3; do
  if [ $i = 0 ]; then role="--head --port=6379 --dashboard-host=127.0.0.1 --dashboard-port=8265"; else role="--address=127.0.0.1:6379"; fi
  # shellcheck disable=SC2046
  set -- $($gpuam ray-node-args --host $h --gpus 8 --topology pcie8)
  ip netns exec "$ns" "$V/ray" start --block $role --node-ip-address=127.0.0.1 --num-cpus=8 \
    --memory=8589934592 --object-store-memory=80000000 --disable-usage-stats \
    --dashboard-agent-listen-port=$((52365 + i)) --temp-dir="$tmp" "$@" >"$tmp/$h.log" 2>&1 &
  i=$((i + 1))
  for _ in $(seq 120); do [ "$(alive)" = "$i" ] && break; sleep 1; done
done
echo "3 nodes ALIVE; load: $(cut -d' ' -f1-3 /proc/loadavg)"
ip netns exec "$ns" env RAY_ADDRESS=127.0.0.1:6379 "$V/python" scripts/ray-launch-bench.py "$n" n1,n2,n3 8 "$tmp/rec"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
