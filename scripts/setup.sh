#!/usr/bin/env bash
# Installs what is missing (Debian 12 packages only), then configures and builds booster in Release
# into build/. Safe to run again: installed packages and an existing build are reused.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake ninja-build pkg-config
          libopenblas-dev libopenblas-openmp-dev libboost-dev libboost-program-options-dev nlohmann-json3-dev catch2
          zlib1g-dev libopenmpi-dev openmpi-bin dataset-fashion-mnist python3-numpy valgrind
          libsentencepiece-dev sentencepiece fortunes wordnet-base libdnnl-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then sudo=sudo; else sudo=; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${BOOSTER_CMAKE_ARGS:-} >/dev/null
cmake --build build --parallel "$(nproc)"
