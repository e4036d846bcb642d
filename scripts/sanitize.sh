#!/usr/bin/env bash
# Builds the CPU code with AddressSanitizer + UndefinedBehaviorSanitizer (CUDA off) into build-asan/
# and runs the test suite there; any report fails the run. Usage:
#   bash scripts/sanitize.sh [ctest arguments, e.g. -R test_checkpoint]
# What is suppressed, and the proof that it lies inside MPI/OpenMP, is in scripts/sanitizers/.
# Not part of CI (the ASan suite takes longer than CI's budget on 2 cores); run it before resolving
# an issue and give its result in the closing note.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# -O1 -g1: what the sanitizers recommend (readable stacks), and much faster to build than -O2 -g.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBOOSTER_CUDA=OFF \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=address,undefined" \
  ${BOOSTER_CMAKE_ARGS:-} >/dev/null
cmake --build build-asan --parallel "$(nproc)"

# fast_unwind_on_malloc=0: stacks through libraries built without frame pointers (OpenMPI) reach them,
# which the suppressions need (scripts/sanitizers/lsan.supp); slower, but only here.
export ASAN_OPTIONS="detect_leaks=1:fast_unwind_on_malloc=0:abort_on_error=1:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=0:allocator_may_return_null=1:verify_asan_link_order=0"
export LSAN_OPTIONS="suppressions=$root/scripts/sanitizers/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$root/scripts/sanitizers/ubsan.supp"
# Left out: the valgrind leak checks (valgrind cannot run an ASan binary), and the CNN accuracy run
# (150 steps of convolutions pass its 900 s limit under ASan on 2 cores; test_conv covers its kernels).
cd build-asan
ctest --output-on-failure --timeout 3000 -j "$(nproc)" -E "valgrind|the CNN config trains Fashion-MNIST" "$@"
