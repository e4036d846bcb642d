#!/bin/sh
# Times one training step of the same two workloads in booster (build/bin/bench_step) and in PyTorch
# (bench/torch_step.py, Debian's /usr/bin/python3 with torch 1.13), with the same thread count, and
# prints a side-by-side table with the ratio ours / PyTorch (below 1: booster is faster).
#
#   bench/run_step_bench.sh [THREADS] [STEPS]      (defaults: 2 threads, 20 timed steps)
#
# Build first: ninja -C build bench_step
set -eu
threads=${1:-2}
steps=${2:-20}
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BOOSTER_BIN_DIR:-$root/build/bin}
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads MKL_NUM_THREADS=$threads

ours=$(mktemp)
theirs=$(mktemp)
trap 'rm -f "$ours" "$theirs"' EXIT
"$bin/bench_step" --steps "$steps" >"$ours"
/usr/bin/python3 "$root/bench/torch_step.py" --steps "$steps" --threads "$threads" >"$theirs"

/usr/bin/python3 - "$ours" "$theirs" "$threads" "$steps" <<'PY'
import json, sys, platform, datetime
ours = {r["workload"]: r for r in map(json.loads, open(sys.argv[1]))}
theirs = {r["workload"]: r for r in map(json.loads, open(sys.argv[2]))}
cpu = "unknown CPU"
try:
    cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
except Exception:
    pass
print(f"# {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {cpu}, {sys.argv[3]} threads, median of {sys.argv[4]} steps")
print(f"| {'workload':30} | {'booster ms':>10} | {'PyTorch ms':>10} | {'ratio':>6} | {'booster GFLOP/s':>15} | {'PyTorch GFLOP/s':>15} |")
print(f"|{'-'*32}|{'-'*12}|{'-'*12}|{'-'*8}|{'-'*17}|{'-'*17}|")
for name, o in ours.items():
    t = theirs.get(name)
    if t is None:
        continue
    print(f"| {name:30} | {o['ms_per_step']:10.2f} | {t['ms_per_step']:10.2f} | {o['ms_per_step'] / t['ms_per_step']:6.2f} "
          f"| {o['gflops']:15.1f} | {t['gflops']:15.1f} |")
PY
