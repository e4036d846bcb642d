#!/usr/bin/env bash
# One device-tool batch: build the CUDA targets, run the CUDA tests, then the GPT-2 benchmarks.
# Usage (from the repo root on the GPU machine): bash bench/cuda_device_batch.sh [bench args...]
set -u
OUT=${OUT:-/tmp/out}
TARGETS=${TARGETS:-"booster_core test_cuda_ops test_cuda_train bench_gpt2_cuda"}
bash bench/cuda_device_run.sh "-k 0 $TARGETS" "true" || exit 1
export OMP_NUM_THREADS=8
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout 240 build/bin/test_cuda_ops -s 2>&1 | grep -v "^\s*$" > $OUT/test_cuda_ops.log; echo "test_cuda_ops rc=${PIPESTATUS[0]}"
  grep -E "value err|FAILED|failed|passed|REQUIRE|CHECK|with expansion|error" $OUT/test_cuda_ops.log | grep -v "PASSED" | head -150
  timeout 240 build/bin/test_cuda_train -s 2>&1 > $OUT/test_cuda_train.log; echo "test_cuda_train rc=$?"
  grep -E "^(mlp|gpt) |FAILED|failed|passed|error" $OUT/test_cuda_train.log | head -60
fi
if [ -n "${BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-200} build/bin/bench_gpt2_cuda $BENCH 2>&1 | tee $OUT/bench_booster.log
  timeout ${BENCH_TIMEOUT:-200} python3 bench/torch_gpt2_cuda.py $BENCH 2>&1 | tee $OUT/bench_torch.log
fi
