#!/usr/bin/env bash
# Builds and checks the CUDA backend on a lent GPU machine (the device tool), whose image lacks our
# Debian build dependencies: they travel as .deb files in $DEPS_DEBS (default ../.devdeps) and are
# unpacked under /tmp/deps. Usage: bash bench/cuda_device_run.sh "<targets>" "<commands to run after>"
# Logs go to $OUT (or /tmp/out).
set -u
OUT=${OUT:-/tmp/out}
DEBS=${DEPS_DEBS:-../.devdeps}
D=/tmp/deps
mkdir -p $D "$OUT"
for f in "$DEBS"/*.deb; do dpkg -x "$f" $D; done
# zlib1g-dev's libz.so points at an absolute path: aim it at the image's own libz.so.1 so the shared
# library is linked (the static libz.a beside it is not built for a shared object).
for z in /lib/x86_64-linux-gnu/libz.so.1 /usr/lib/x86_64-linux-gnu/libz.so.1; do
  [ -e $z ] && { rm -f $D/usr/lib/x86_64-linux-gnu/libz.a; ln -sf $z $D/usr/lib/x86_64-linux-gnu/libz.so; break; }
done
export LD_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu/openblas-openmp:$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export CPATH=$D/usr/include:${CPATH:-}
export PATH=/usr/local/cuda/bin:$PATH
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__ if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0]))' 2>/dev/null)
[ -z "$NCCL_DIR" ] && NCCL_DIR=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)
echo "NCCL_DIR=$NCCL_DIR"
[ -n "$NCCL_DIR" ] && export LD_LIBRARY_PATH=$NCCL_DIR/lib:$LD_LIBRARY_PATH
ls $NCCL_DIR/lib $NCCL_DIR/include 2>/dev/null | head
# The wheel ships libnccl.so.2 only; give the linker its unversioned name.
if [ -n "$NCCL_DIR" ] && [ ! -e $NCCL_DIR/lib/libnccl.so ]; then mkdir -p /tmp/nccl/lib; ln -sf $NCCL_DIR/lib/libnccl.so.2 /tmp/nccl/lib/libnccl.so; NCCL_LINK=/tmp/nccl/lib; else NCCL_LINK=$NCCL_DIR/lib; fi
export LD_LIBRARY_PATH=$NCCL_LINK:$LD_LIBRARY_PATH
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBOOSTER_CUDA=ON \
  -DCMAKE_PREFIX_PATH="$D/usr;$D/usr/lib/x86_64-linux-gnu/cmake" \
  -DOPENBLAS_OPENMP_LIBRARY=$D/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so \
  -DOPENBLAS_INCLUDE_DIR=$D/usr/include/x86_64-linux-gnu/openblas-openmp \
  > "$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log"; exit 1; }
grep -E "CUDA|NCCL|BLAS|MPI" "$OUT/configure.log"
time ninja -C build -j16 $1 > "$OUT/build.log" 2>&1 || { grep -B2 -A12 -E "error|FAILED" "$OUT/build.log" | head -120; exit 1; }
echo "build ok"
eval "$2"
