#!/bin/sh
# Times one training step of the two bench workloads in booster (`booster bench`) for every precision
# and in PyTorch (bench/torch_step.py, Debian's /usr/bin/python3 with torch 1.13: fp32 and bf16
# autocast, the CPU autocast it has) with the same thread count, alternating the two frameworks, and
# prints a table: ms/step, GFLOP/s, ratios to PyTorch and to our fp32, process CPU time per step (with
# OMP_WAIT_POLICY=passive, the work done, robust to other jobs on the machine), peak tensor memory; then the
# Booster's overhead against the hand-written loop (float32, no plugin; Note [Booster overhead]).
#
#   bench/run_bench.sh [THREADS] [STEPS] [REPEATS]    (defaults: 2 threads, 20 timed steps, 1 repeat)
#
# Each figure is the median of STEPS steps after warm-up; with REPEATS > 1 the median of the runs'
# medians. Build first: ninja -C build booster
set -eu
threads=${1:-2}
steps=${2:-20}
repeats=${3:-1}
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BOOSTER_BIN_DIR:-$root/build/bin}
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads MKL_NUM_THREADS=$threads

results=$(mktemp)
trap 'rm -f "$results"' EXIT
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for r in $(seq "$repeats"); do
  for w in mlp gpt; do
    for p in fp32 bf16; do
      "$bin/booster" bench --workload "$w" --precision "$p" --steps "$steps" >>"$results"
      # PyTorch 1.13's bf16 autocast on the CPU takes seconds per step: 3 steps after 1 warm-up.
      tsteps=$steps twarm=3
      [ "$p" = bf16 ] && tsteps=$((steps < 3 ? steps : 3)) twarm=1
      /usr/bin/python3 "$root/bench/torch_step.py" --workload "$w" --precision "$p" --steps "$tsteps" \
        --warmup "$twarm" --threads "$threads" >>"$results"
    done
    for p in fp16 fp16_naive; do
      "$bin/booster" bench --workload "$w" --precision "$p" --steps "$steps" >>"$results"
    done
    "$bin/booster" bench --workload "$w" --precision fp32 --steps "$steps" --compare-hand-written >>"$results"
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

/usr/bin/python3 - "$results" "$threads" "$steps" "$repeats" "$load_before" "$load_after" <<'PY'
import collections, datetime, json, statistics, sys
path, threads, steps, repeats, load_before, load_after = sys.argv[1:]
runs = collections.defaultdict(list)
overhead = collections.defaultdict(list)
for line in open(path):
    r = json.loads(line)
    if "booster_overhead" in r:
        overhead[r["workload"]].append(r)
    else:
        runs[(r["framework"], r["workload"], r["precision"])].append(r)

def med(key, field):
    rs = runs.get(key)
    return statistics.median(r[field] for r in rs) if rs else None

cpu = "unknown CPU"
try:
    cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
except Exception:
    pass
print(f"# {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {cpu}, {threads} threads, median of {steps} steps"
      f" x {repeats} run(s); load average {load_before} before, {load_after} after")
print("| workload | precision | booster ms | GFLOP/s | PyTorch ms | x PyTorch | x PyTorch fp32 | x our fp32 "
      "| CPU ms (x our fp32) | peak tensor MB |")
print("|---|---|---|---|---|---|---|---|---|---|")
fmt = lambda v, spec: "-" if v is None else format(v, spec)
for w in ("mlp", "gpt"):
    ours_fp32 = med(("booster", w, "fp32"), "ms_per_step")
    ours_fp32_cpu = med(("booster", w, "fp32"), "cpu_ms_per_step")
    torch_fp32 = med(("pytorch", w, "fp32"), "ms_per_step")
    for p in ("fp32", "fp16", "bf16", "fp16_naive"):
        ms = med(("booster", w, p), "ms_per_step")
        if ms is None:
            continue
        gf = med(("booster", w, p), "gflops")
        peak = med(("booster", w, p), "peak_tensor_bytes")
        cpu_ms = med(("booster", w, p), "cpu_ms_per_step")
        tms = med(("pytorch", w, p), "ms_per_step")
        print(f"| {w} | {p} | {ms:.2f} | {gf:.1f} | {fmt(tms, '.2f')} | {fmt(tms and ms / tms, '.2f')} "
              f"| {fmt(torch_fp32 and ms / torch_fp32, '.2f')} | {fmt(ours_fp32 and ms / ours_fp32, '.2f')} "
              f"| {cpu_ms:.1f} ({fmt(ours_fp32_cpu and cpu_ms / ours_fp32_cpu, '.2f')}) | {peak / 1e6:.1f} |")
for w, rs in overhead.items():
    b = statistics.median(r["ms_per_step"] for r in rs)
    h = statistics.median(r["hand_written_ms_per_step"] for r in rs)
    bc = statistics.median(r["cpu_ms_per_step"] for r in rs)
    hc = statistics.median(r["hand_written_cpu_ms_per_step"] for r in rs)
    print(f"Booster overhead, {w} fp32: boosted {b:.2f} ms vs hand-written {h:.2f} ms ({100 * (b / h - 1):+.1f}%); "
          f"CPU time {bc:.2f} vs {hc:.2f} ms ({100 * (bc / hc - 1):+.1f}%)")
PY
