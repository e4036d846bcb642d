#!/usr/bin/env bash
# One device-tool batch: build the CUDA targets, run the CUDA tests, then the GPT-2 benchmarks.
# Usage (from the repo root on the GPU machine): bash bench/cuda_device_batch.sh [bench args...]
set -u
OUT=${OUT:-/tmp/out}
TARGETS=${TARGETS:-"booster_core booster_plugin_single booster_plugin_ddp booster_plugin_low_level_zero test_cuda_ops test_cuda_train test_cuda_plugins test_cuda_nccl bench_gpt2_cuda"}
bash bench/cuda_device_run.sh "-k 0 $TARGETS" "true" || exit 1
export OMP_NUM_THREADS=8
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout 240 build/bin/test_cuda_ops > $OUT/test_cuda_ops.log 2>&1; echo "test_cuda_ops rc=$?"
  grep -E "FAILED" -A10 $OUT/test_cuda_ops.log | head -80; tail -3 $OUT/test_cuda_ops.log
  timeout 240 build/bin/test_cuda_train > $OUT/test_cuda_train.log 2>&1; echo "test_cuda_train rc=$?"
  grep -E "^(mlp|gpt) |FAILED|failed|passed|error" $OUT/test_cuda_train.log | head -60
  timeout 120 build/bin/test_cuda_plugins > $OUT/test_cuda_plugins.log 2>&1; echo "test_cuda_plugins rc=$?"
  grep -E "FAILED|failed|passed|error|skipped|SKIP" -A6 $OUT/test_cuda_plugins.log | head -40
  timeout 60 build/bin/test_cuda_nccl > $OUT/test_cuda_nccl.log 2>&1; echo "test_cuda_nccl rc=$?"
  grep -E "FAILED|failed|passed|error|skipped" -A6 $OUT/test_cuda_nccl.log | head -40
fi
if [ -n "${CPU_TESTS:-}" ]; then
  ninja -C build -j16 $CPU_TESTS > $OUT/build_cpu_tests.log 2>&1 || { grep -B2 -A12 -E "error|FAILED" $OUT/build_cpu_tests.log | head -60; }
  for t in $CPU_TESTS; do timeout 120 build/bin/$t > $OUT/$t.log 2>&1; echo "$t rc=$? $(tail -2 $OUT/$t.log | tr '\n' ' ')"; done
fi
if [ -n "${BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-200} build/bin/bench_gpt2_cuda $BENCH 2>&1 | tee $OUT/bench_booster.log
  [ -z "${SKIP_TORCH:-}" ] && timeout ${BENCH_TIMEOUT:-200} python3 bench/torch_gpt2_cuda.py $BENCH 2>&1 | tee $OUT/bench_torch.log
fi
