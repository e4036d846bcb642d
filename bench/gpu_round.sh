#!/usr/bin/env bash
# One device-tool round for the GPU work (issue 20): build the CUDA targets, run the CUDA tests with
# a compact summary, then the GPT-2 benchmark (and, with TORCH=1, PyTorch's on the same GPU; with
# PROFILE=1, booster's per-kernel-family profile). Logs go to $OUT.
# Usage on the GPU machine: DEPS_DEBS=.devdeps [BENCH="--batch 8 --steps 8 --warmup 2"] bash bench/gpu_round.sh
# The machine's image lacks our Debian build dependencies; fetch them here first and carry the folder:
#   mkdir -p .devdeps && (cd .devdeps && apt-get download libopenblas-dev libopenblas0-openmp \
#     libopenblas-openmp-dev libopenblas0 libboost-dev libboost1.74-dev libboost-program-options1.74-dev \
#     libboost-program-options1.74.0 libboost-program-options-dev nlohmann-json3-dev catch2 zlib1g-dev libgfortran5)
#   echo /.devdeps/ >> .git/info/exclude
set -u
OUT=${OUT:-/tmp/out}
TARGETS=${TARGETS:-"booster_core booster_plugin_single booster_plugin_ddp booster_plugin_low_level_zero test_cuda_ops test_cuda_attention test_cuda_classifier test_cuda_train test_cuda_plugins test_cuda_nccl test_cuda_fp8 bench_gpt2_cuda"}
bash bench/cuda_device_run.sh "-k 0 $TARGETS" "true" || exit 1
export OMP_NUM_THREADS=8
for t in ${TESTS:-test_cuda_attention test_cuda_classifier test_cuda_ops test_cuda_train test_cuda_plugins test_cuda_nccl test_cuda_fp8}; do
  timeout 300 build/bin/$t > $OUT/$t.log 2>&1
  echo "== $t rc=$? $(grep -E '^(test cases|All tests)' $OUT/$t.log | tr '\n' ' ')"
  grep -E "FAILED" -A14 $OUT/$t.log | grep -E "FAILED|CHECK|REQUIRE|  [a-z].*(under|difference|step|cpu|error|bound)|with expansion" -A1 | grep -vE "^\s*$|^--" | cut -c1-160 | head -${FAIL_LINES:-40}
done
[ -f $OUT/test_cuda_attention.log ] && grep -E "^(flash|unfused) " $OUT/test_cuda_attention.log | head -30
BENCH=${BENCH:-"--batch 8 --steps 8 --warmup 2"}
timeout 200 build/bin/bench_gpt2_cuda $BENCH ${BENCH_PRECISIONS:-} 2>&1 | tee $OUT/bench_booster.log | cut -c1-400
if [ "${PROFILE:-0}" = 1 ]; then
  BOOSTER_CUDA_PROFILE=1 timeout 200 build/bin/bench_gpt2_cuda --batch 8 --steps 3 --warmup 1 --precision bf16 > $OUT/profile_bf16.txt 2>&1
  head -45 $OUT/profile_bf16.txt | tail -42 | cut -c1-90
fi
[ "${TORCH:-0}" = 1 ] && timeout 200 python3 bench/torch_gpt2_cuda.py $BENCH 2>&1 | tee $OUT/bench_torch.log | cut -c1-300
exit 0
