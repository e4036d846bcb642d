#!/usr/bin/env bash
# The installed package as a user meets it: install into a prefix, move the prefix, build
# examples/external_project against it with find_package(booster) (and a pkg-config build), train its
# own module under two strategies, load its own precision plugin by name (BOOSTER_PLUGIN_PATH) and
# by path (from a config, through the library and through the installed `booster` command), and train
# its own model library's model with the installed `booster` command, and train its own module on .npy
# files through the Trainer, stopped by SIGTERM and resumed to the same bytes.
# usage: test_install.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd) source=$(cd "$2" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
step() { echo "--- $*"; }

step "install into a prefix, then move it"
cmake --install "$build" --prefix "$work/first" >/dev/null
mv "$work/first" "$work/moved"
prefix=$work/moved
test -f "$prefix/include/booster/booster.h"
test -f "$prefix/lib/cmake/booster/boosterConfig.cmake"
test -f "$prefix/lib/booster/libbooster_plugin_ddp.so"
for private in booster/kernels booster/backends/cpu booster/ops/ops_impl.h booster/optim/fused_kernels.h; do
  if [ -e "$prefix/include/$private" ]; then echo "private header installed: $private"; exit 1; fi
done
if grep -rqs "$work/first" "$prefix"; then echo "the prefix names where it was installed:"; grep -rls "$work/first" "$prefix"; exit 1; fi

step "every installed header compiles on its own against the prefix"
(cd "$prefix/include" && find booster -name '*.h' | sort) > "$work/headers.txt"
while read -r h; do printf '#include <%s>\n' "$h" > "$work/one_$(echo "$h" | tr '/.' '__').cpp"; done < "$work/headers.txt"
ls "$work"/one_*.cpp | xargs -P 2 -I{} sh -c \
  'c++ -std=c++20 -fsyntax-only -DBOOST_DLL_USE_STD_FS -I"$0/include" "{}" || { echo "does not compile alone: {}"; exit 255; }' "$prefix"
echo "$(wc -l < "$work/headers.txt") headers"

step "the moved command runs and finds the moved plugins"
"$prefix/bin/booster" --version
"$prefix/bin/booster" plugins > "$work/plugins.txt"
grep -q "file: $prefix/lib/booster/libbooster_plugin_ddp.so" "$work/plugins.txt"

step "a copy of the build tree runs its own libraries and plugins, not the original's"
mkdir -p "$work/build_copy"
cp -a "$build/bin" "$build/lib" "$work/build_copy/"
"$work/build_copy/bin/booster" plugins > "$work/copy_plugins.txt"
grep -q "file: $work/build_copy/lib/libbooster_plugin_ddp.so" "$work/copy_plugins.txt"
LD_DEBUG=libs "$work/build_copy/bin/booster" --version 2> "$work/copy_libs.txt" >/dev/null
grep -q "init: $work/build_copy/bin/../lib/libbooster_core.so" "$work/copy_libs.txt"
rm -rf "$work/build_copy"

step "build the external project with find_package(booster)"
cmake -S "$source/examples/external_project" -B "$work/ext" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work/ext" >/dev/null
ext=$work/ext

step "its own model under two strategies"
"$ext/train_residual_mlp" fp32
"$ext/train_residual_mlp" fp16

step "its own precision plugin by name, on BOOSTER_PLUGIN_PATH"
BOOSTER_PLUGIN_PATH="$ext" "$ext/train_residual_mlp" scaled_bf16 | tee "$work/by_name.txt"
grep -q "^scaled_bf16:" "$work/by_name.txt"
if "$ext/train_residual_mlp" scaled_bf16 2> "$work/missing.txt"; then echo "found without BOOSTER_PLUGIN_PATH"; exit 1; fi
grep -q "BOOSTER_PLUGIN_PATH" "$work/missing.txt"

step "by path, from a config"
printf '{"mixed_precision": {"name": "%s", "loss_scale": 8}}\n' "$ext/libbooster_precision_scaled_bf16.so" > "$work/run.json"
"$ext/train_residual_mlp" --config "$work/run.json" | tee "$work/by_path.txt"
grep -q "^scaled_bf16:" "$work/by_path.txt"

step "its own model library: booster train builds my_net from a config, by name and by path"
cat > "$work/my_net.json" <<JSON
{"model": {"type": "my_net", "library": "my_net", "in": 8, "width": 16, "blocks": 1, "classes": 3},
 "optimizer": {"type": "adam", "lr": 0.01},
 "data": {"type": "synthetic", "num_samples": 256, "num_test_samples": 64, "num_features": 8, "num_classes": 3,
          "batch_size": 32},
 "train": {"epochs": 2, "run_dir": null}}
JSON
BOOSTER_PLUGIN_PATH="$ext" "$prefix/bin/booster" train --config "$work/my_net.json" > "$work/my_net.txt"
tail -1 "$work/my_net.txt" | grep -q '"test_accuracy"'
"$prefix/bin/booster" check --config "$work/my_net.json" --set model.library="$ext/libbooster_model_my_net.so" >/dev/null
# Its Residual blocks are objects of the library's own class: under every strategy, and data parallel,
# the run must end cleanly (the library stays loaded until the last of them is gone).
for mp in bf16 fp16 fp16_naive fp8; do
  BOOSTER_PLUGIN_PATH="$ext" "$prefix/bin/booster" train --config "$work/my_net.json" --mixed-precision $mp \
    --set train.max_steps=2 > /dev/null || { echo "my_net under $mp exited $?"; exit 1; }
done
BOOSTER_PLUGIN_PATH="$ext" "$prefix/bin/booster" train --config "$work/my_net.json" --plugin ddp --mixed-precision bf16 \
  --set train.max_steps=2 > /dev/null || { echo "my_net under ddp bf16 exited $?"; exit 1; }
if "$prefix/bin/booster" check --config "$work/my_net.json" 2> "$work/my_net_missing.txt"; then echo "my_net found without BOOSTER_PLUGIN_PATH"; exit 1; fi
grep -q "libbooster_model_my_net.so" "$work/my_net_missing.txt"

step "its own module on its own .npy files through the Trainer: SIGTERM mid-run, resume, same bytes"
npy=$source/tests/fixtures/file_data
"$ext/train_npy" "$npy/blobs_x.npy" "$npy/blobs_y.npy" "$work/npy_whole" --epochs 400 > "$work/npy_whole.txt" 2>/dev/null
"$ext/train_npy" "$npy/blobs_x.npy" "$npy/blobs_y.npy" "$work/npy_parts" --epochs 400 > /dev/null 2> "$work/npy_stopped.txt" &
pid=$!
for _ in $(seq 1 600); do grep -q '^step ' "$work/npy_stopped.txt" 2>/dev/null && break; sleep 0.05; done
kill -TERM "$pid"
status=0; wait "$pid" || status=$?
if [ "$status" != 143 ]; then echo "train_npy exited $status after SIGTERM, not 143:"; cat "$work/npy_stopped.txt"; exit 1; fi
grep -q "stopped by SIGTERM after step" "$work/npy_stopped.txt"
test -f "$work/npy_parts/checkpoints/latest"
"$ext/train_npy" "$npy/blobs_x.npy" "$npy/blobs_y.npy" "$work/npy_parts" --epochs 400 --resume latest > "$work/npy_resumed.txt" 2>/dev/null
grep -q '"resumed_from":"' "$work/npy_resumed.txt"
last=$(cat "$work/npy_whole/checkpoints/latest")
test "$last" = "$(cat "$work/npy_parts/checkpoints/latest")"
for f in model/model.safetensors optimizer/optimizer.safetensors trainer_state.json; do
  cmp "$work/npy_whole/checkpoints/$last/$f" "$work/npy_parts/checkpoints/$last/$f" || { echo "differs after resume: $f"; exit 1; }
done
test "$(tail -1 "$work/npy_whole/metrics.jsonl" | sed 's/"time":[^,}]*//')" = "$(tail -1 "$work/npy_parts/metrics.jsonl" | sed 's/"time":[^,}]*//')"

step "pkg-config"
cat > "$work/pc.cpp" <<'CPP'
#include <booster/booster.h>
#include <cstdio>
int main() {
  booster::Tensor t = booster::ones({2, 3});
  std::printf("sum %g\n", booster::sum(t).item());
  return booster::sum(t).item() == 6.0 ? 0 : 1;
}
CPP
PKG_CONFIG_PATH="$prefix/lib/pkgconfig" c++ "$work/pc.cpp" -o "$work/pc" \
  $(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs booster)
"$work/pc"
step "add_subdirectory of the source tree: configures, gives booster::core, leaks no settings"
mkdir -p "$work/sub"
cat > "$work/sub/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.25)
project(uses_booster_source LANGUAGES CXX)
add_subdirectory("$source" booster)
get_directory_property(options COMPILE_OPTIONS)
get_directory_property(definitions COMPILE_DEFINITIONS)
if(options OR definitions OR DEFINED CMAKE_CXX_STANDARD OR DEFINED CMAKE_RUNTIME_OUTPUT_DIRECTORY)
  message(FATAL_ERROR "booster leaked settings into its parent: '\${options}' '\${definitions}'")
endif()
add_executable(app "$work/pc.cpp")
target_link_libraries(app PRIVATE booster::core)
CMAKE
cmake -S "$work/sub" -B "$work/sub/build" -G Ninja -DBOOSTER_CUDA=OFF > "$work/sub.log" 2>&1 || { cat "$work/sub.log"; exit 1; }
ninja -C "$work/sub/build" -t targets all > "$work/sub/targets.txt"
grep -q "^app:" "$work/sub/targets.txt"
if grep -q "test_plugin" "$work/sub/targets.txt"; then echo "a subproject builds booster's tests"; exit 1; fi
echo "install test passed"
