#!/usr/bin/env bash
# Shakes the comparison tests: every test that compares two runs whose sums are ordered differently
# (the Catch tag [roundoff] outside tests/mpi, and the files of tests/mpi, which compare layouts
# throughout) runs again under each summation order a machine may produce: OpenBLAS and OpenMP
# thread counts 1, 2 and 3, and each BOOSTER_CPU_ISA level this CPU supports. Every test must pass
# under every setting (tests/roundoff.h derives their bounds). OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE
# are left as the machine sets them.
#
#   scripts/perturb.sh            the full grid (thread counts x ISA levels)
#   scripts/perturb.sh --quick    each thread count and each ISA level once (1/baseline, 2/avx2, 3/avx512)
#   BUILD=dir scripts/perturb.sh  another build folder (default build/)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
bin="$build/bin"
[ -x "$bin/booster" ] || { echo "perturb: no $bin/booster; build first (bash scripts/setup.sh)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "perturb: mpirun is missing (apt-get install openmpi-bin)" >&2; exit 2; }

# The ISA levels this CPU runs (the library refuses the others with "is not supported by this CPU").
isas=()
for isa in baseline avx2 avx512; do
  if ! BOOSTER_CPU_ISA=$isa "$bin/booster" --version 2>&1 | grep -q "not supported by this CPU"; then isas+=("$isa"); fi
done

settings=()
if [ "${1:-}" = "--quick" ]; then
  threads=(1 2 3)
  for i in 0 1 2; do settings+=("${threads[$i]} ${isas[$((i < ${#isas[@]} ? i : ${#isas[@]} - 1))]}"); done
else
  for t in 1 2 3; do for isa in "${isas[@]}"; do settings+=("$t $isa"); done; done
fi

# Test programs with [roundoff] cases (outside tests/mpi), and the MPI programs with their rank counts.
tagged=()
for src in $(grep -l '\[roundoff\]' tests/*/test_*.cpp | grep -v '^tests/mpi/'); do tagged+=("$(basename "$src" .cpp)"); done
mpi_runs=("2 test_mpi_ddp" "2 test_mpi_llama" "2 test_mpi_zero" "4 test_mpi_zero zero3*" "2 test_mpi_pipeline" "4 test_mpi_pipeline"
          "2 test_mpi_tensor_parallel" "4 test_mpi_hybrid" "2 test_mpi_families" "2 test_mpi_lora"
          "2 test_mpi_lora_hybrid" "4 test_mpi_lora_hybrid [hybrid_4_ranks]" "2 test_mpi_token_mean" "4 test_mpi_token_mean [packed_pp]" "2 test_mpi_reproducible" "4 test_mpi_reproducible")

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive
failed=()
passed=0
log_dir=$(mktemp -d /tmp/booster_perturb.XXXXXX)
for setting in "${settings[@]}"; do
  read -r t isa <<<"$setting"
  export OPENBLAS_NUM_THREADS=$t OMP_NUM_THREADS=$t BOOSTER_CPU_ISA=$isa BOOSTER_PERTURB_THREADS=$t
  for name in "${tagged[@]}"; do
    label="$name [roundoff] (threads $t, $isa)"
    log="$log_dir/${name}_${t}_${isa}.log"
    if "$bin/$name" "[roundoff]" >"$log" 2>&1; then passed=$((passed + 1)); echo "ok     $label"
    else failed+=("$label: $log"); echo "FAILED $label (log: $log)"; fi
  done
  for run in "${mpi_runs[@]}"; do
    read -r np name filter <<<"$run"
    label="$name on $np ranks${filter:+ ($filter)} (threads $t, $isa)"
    log="$log_dir/${name}_${np}_${t}_${isa}.log"
    if mpirun -np "$np" --oversubscribe -x OPENBLAS_NUM_THREADS -x OMP_NUM_THREADS -x BOOSTER_CPU_ISA \
         -x OMP_WAIT_POLICY "$bin/$name" ${filter:+"$filter"} >"$log" 2>&1; then
      passed=$((passed + 1)); echo "ok     $label"
    else failed+=("$label: $log"); echo "FAILED $label (log: $log)"; fi
  done
done
echo "perturb: settings ${settings[*]/ /\/} over ISA levels ${isas[*]}"
for f in "${failed[@]}"; do echo "failed: $f"; done
echo "perturb: ${passed} passed, ${#failed[@]} failed"
[ ${#failed[@]} -eq 0 ]
