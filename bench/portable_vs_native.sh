#!/usr/bin/env bash
# The portable build (CPU kernels per ISA level, picked at run time) against a -march=native build of
# the same source, on the same machine in one run: each row alternates the two builds R times and
# prints the medians of `booster bench` (wall ms and process CPU ms per step) and portable / native.
#
#   cmake -S . -B build-native -G Ninja -DCMAKE_BUILD_TYPE=Release -DBOOSTER_NATIVE=ON -DBOOSTER_BUILD_TESTS=OFF
#   ninja -C build-native booster
#   bench/portable_vs_native.sh build build-native [THREADS=2] [STEPS=20] [REPEATS=3]
set -euo pipefail
portable=$1 native=$2 threads=${3:-2} steps=${4:-20} repeats=${5:-3}
median() { sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }
field() { python3 -c "import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['$1'])"; }
echo "portable: $("$portable/bin/booster" --version | grep 'CPU kernels')"
echo "native:   $("$native/bin/booster" --version | grep 'CPU kernels')"
echo "threads $threads, $steps timed steps, $repeats alternating runs per build"
echo
echo "| workload | precision | portable ms | native ms | portable / native | portable CPU ms | native CPU ms | CPU ratio |"
echo "|---|---|---|---|---|---|---|---|"
for workload in mlp gpt; do
  for precision in fp32 fp16 bf16; do
    pw=() nw=() pc=() nc=()
    for ((r = 0; r < repeats; ++r)); do
      for which in portable native; do
        dir=$portable; [ "$which" = native ] && dir=$native
        out=$(OMP_NUM_THREADS=$threads "$dir/bin/booster" bench --workload "$workload" --precision "$precision" --steps "$steps")
        if [ "$which" = portable ]; then pw+=("$(field ms_per_step <<< "$out")"); pc+=("$(field cpu_ms_per_step <<< "$out")")
        else nw+=("$(field ms_per_step <<< "$out")"); nc+=("$(field cpu_ms_per_step <<< "$out")"); fi
      done
    done
    p=$(printf '%s\n' "${pw[@]}" | median) n=$(printf '%s\n' "${nw[@]}" | median)
    pcm=$(printf '%s\n' "${pc[@]}" | median) ncm=$(printf '%s\n' "${nc[@]}" | median)
    awk -v w="$workload" -v pr="$precision" -v p="$p" -v n="$n" -v pc="$pcm" -v nc="$ncm" \
      'BEGIN { printf "| %s | %s | %.2f | %.2f | %.3f | %.2f | %.2f | %.3f |\n", w, pr, p, n, p / n, pc, nc, pc / nc }'
  done
done
