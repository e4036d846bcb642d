#!/usr/bin/env bash
# The Llama's training step, booster (bench_llama) against PyTorch (torch_llama.py) alternating, then
# generation with and without the key/value cache (bench/README.md, "The Llama on the CPU").
#   bench/llama_bench.sh [THREADS] [REPEATS] [-- SIZE OPTIONS for both, e.g. --seq 256 --batch 2]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}; repeats=${2:-1}; shift $(( $# >= 2 ? 2 : $# )); [ "${1:-}" = "--" ] && shift
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $threads threads, load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$repeats"); do
  build/bin/bench_llama train "$@"
  /usr/bin/python3 bench/torch_llama.py "$@"
done
build/bin/bench_llama generate --steps 1 "$@"
