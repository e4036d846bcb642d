#!/usr/bin/env bash
# Threads on an idle and on a busy machine (bench/README.md, "Threads on a busy machine"): training
# speed of a tiny Llama (hidden 64, bench_llama) and of the GPT workload (booster bench), each under
# several thread settings, first idle, then with BUSY other processes (`yes > /dev/null`) running.
#   bench/threads.sh [BUSY] [STEPS]      (BUSY: 2, STEPS: 30)
# Prints one markdown row per (load, setting): tiny Llama samples/s and GPT GFLOP/s.
set -euo pipefail
cd "$(dirname "$0")/.."
busy=${1:-2}; steps=${2:-30}
llama=(build/bin/bench_llama train --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 172 --vocab 256
       --seq 64 --batch 16 --steps "$steps" --warmup 3)
settings=("default" "OMP_NUM_THREADS=1" "OMP_WAIT_POLICY=passive" "BOOSTER_PARALLEL_GRAIN=262144"
          "BOOSTER_PARALLEL_GRAIN=262144 OMP_WAIT_POLICY=passive")
field() { grep -o "\"$1\":[0-9.e+-]*" | head -1 | cut -d: -f2; }
run_all() {
  local load=$1
  for s in "${settings[@]}"; do
    local envs=(); [ "$s" != default ] && read -r -a envs <<< "$s"
    local ms gf
    ms=$(env "${envs[@]}" "${llama[@]}" 2>/dev/null | field ms_per_step)
    gf=$(env "${envs[@]}" build/bin/booster bench --workload gpt --steps "$((steps / 3 + 1))" 2>/dev/null | field gflops)
    printf '| %s | %s | %.0f | %.1f | %s |\n' "$load" "$s" "$(echo "16000 / $ms" | bc -l)" "$gf" \
      "$(cut -d' ' -f1 /proc/loadavg)"
  done
}
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
echo "| machine | setting | tiny Llama samples/s | GPT GFLOP/s | load (1 min) |"
echo "|---|---|---|---|---|"
run_all idle
pids=()
for _ in $(seq "$busy"); do yes > /dev/null & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
sleep 1
run_all "$busy busy"
