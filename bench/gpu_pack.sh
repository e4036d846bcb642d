#!/usr/bin/env bash
# Packs one GPU round (bench/gpu_round.sh) into the ignored .device/, so that nothing is compiled on the
# lent GPU machine: builds the CUDA targets here (under the shared build lock), strips copies of
# build/bin's chosen programs and build/lib's libraries, and carries the runtime the machine's image
# lacks (OpenBLAS, Boost.ProgramOptions, SentencePiece, libgfortran, and Debian 12's OpenMPI 4.1 with
# PMIx, hwloc and libevent, relocated through OPAL_PREFIX/PMIX_PREFIX). Then proves the pack here: ldd
# and `mpirun -np 2/-np 4` in a mount namespace that hides this machine's copies of all of them.
#
#   bash bench/gpu_pack.sh                 # build, pack, verify (a few minutes when the build is current)
#   BUILD=0 bash bench/gpu_pack.sh         # pack build/ as it is
#   VERIFY=0 ... / DRY=1 ...               # skip the namespace check / also dry-run gpu_round.sh there
#                                          # (no GPU: CUDA tests skip) from /tmp/gpu_dry, OUT=/tmp/gpu_dry_out
#   TARGETS="booster_core test_cuda_ops" bash bench/gpu_pack.sh   # other targets (built and packed)
#
# .device/ then holds build.tar.xz (build/bin + build/lib, unpacked in the repo root), deps.tar.xz
# (unpacked at /tmp/deps: usr/lib/x86_64-linux-gnu, usr/bin/mpirun, the MCA components, help files;
# fallback/ holds libraries the image almost surely has, used only where it has not) and MANIFEST.txt.
# The device call carries [".device"]; the binaries keep this tree's absolute paths (BOOSTER_FIXTURE_DIR,
# BOOSTER_BIN_DIR), which gpu_round.sh satisfies by linking /work/main to the repo root there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEV=$ROOT/.device
STAGE=${STAGE:-/tmp/gpu_pack_stage}
LOCK=/tmp/booster-build.lock
ARCH=x86_64-linux-gnu
BUILD=${BUILD:-1}
VERIFY=${VERIFY:-1}
DRY=${DRY:-0}
log() { printf '== %s\n' "$*"; }

# ------------------------------------------------------------------------------------------ build
targets_known() { ninja -C build -t targets all 2>/dev/null | sed -n 's/: phony$//p'; }
if [ "$BUILD" = 1 ]; then
  # The core first: a new source (tests/mpi/test_mpi_cuda.cpp) regenerates build.ninja on the way.
  log "building booster_core (waiting for $LOCK)"
  flock $LOCK cmake --build build -j "${JOBS:-2}" --target booster_core
fi
if [ -z "${TARGETS:-}" ]; then
  known=$(targets_known)
  TARGETS="booster_core booster"
  TARGETS+=" $(grep -E '^booster_(plugin|precision)_' <<<"$known" | tr '\n' ' ')"
  TARGETS+=" $(grep -E '^test_cuda_' <<<"$known" | tr '\n' ' ')"
  # test_mpi_process_group: the launcher's smoke test before test_mpi_cuda (and without it).
  TARGETS+=" $(grep -xE 'test_mpi_cuda|test_mpi_process_group|bench_gpt2_cuda|bench_llama' <<<"$known" | tr '\n' ' ')"
  grep -qx test_mpi_cuda <<<"$known" || log "no test_mpi_cuda target yet: packing without it"
  # bench_llama has no CUDA mode (CPU only): not packed.
fi
TARGETS=$(echo $TARGETS)
if [ "$BUILD" = 1 ]; then
  log "building: $TARGETS"
  flock $LOCK cmake --build build -j "${JOBS:-2}" --target $TARGETS
fi

# ------------------------------------------------------------------------------------------ stage
rm -rf "$STAGE" && mkdir -p "$STAGE/build/bin" "$STAGE/build/lib" "$STAGE/deps/usr/lib/$ARCH" "$STAGE/deps/fallback"
bins=()
for t in $TARGETS; do [ -x "build/bin/$t" ] && bins+=("$t"); done
for t in "${bins[@]}"; do strip --strip-unneeded -o "$STAGE/build/bin/$t" "build/bin/$t"; done
for so in build/lib/*.so; do strip --strip-unneeded -o "$STAGE/build/lib/${so##*/}" "$so"; done
newest_src=$(git ls-files -z --cached --others --exclude-standard core mixed_precision plugins cli tests bench cmake CMakeLists.txt |
             xargs -0 stat -c '%Y %n' 2>/dev/null | grep -vE ' bench/[^/]+\.(sh|py|md)$' | sort -n | tail -1)
stamp() { date -u -d "@$1" '+%H:%M:%S UTC'; }
if [ "${newest_src%% *}" -gt "$(stat -c %Y build/lib/libbooster_core.so)" ]; then
  log "warning: ${newest_src#* } is newer than build/lib/libbooster_core.so (BUILD=0, or a file the targets do not use)"
fi
log "packing ${#bins[@]} programs: ${bins[*]}"

# OpenMPI as Debian installs it (openmpi-bin, openmpi-common, libopenmpi3, libpmix2), less Java, Fortran,
# OpenSHMEM, compiler wrappers and the network-fabric components (UCX, OFI, PSM, verbs: a single machine
# talks over shared memory, and their libraries would need the fabric stacks too).
OMPI_SKIP='/share/(doc|man|lintian)/|java|mpifh|usempi|oshmem|/bin/(osh|shmem|mpi(CC|c\+\+|cc|cxx|f77|f90|fort|javac)|opal(cc|c\+\+|_wrapper)|ortecc|aggregate_profile|profile2mat)|mca_(atomic|memheap|scoll|spml|sshmem)_|_(ucx|ofi|psm|psm2|openib|verbs)\.so|common_(ucx|ofi|verbs)|reachable_netlink|-wrapper-data|openmpi-totalview'
for p in openmpi-bin openmpi-common libopenmpi3 libpmix2; do
  dpkg -L "$p" | while read -r f; do
    { [ -f "$f" ] || [ -L "$f" ]; } && [ ! -d "$f" ] || continue
    grep -qE "$OMPI_SKIP" <<<"$f" && continue
    mkdir -p "$STAGE/deps$(dirname "$f")" && cp -a "$f" "$STAGE/deps$f"
  done
done
for n in mpirun mpiexec; do ln -sfn orterun "$STAGE/deps/usr/bin/$n"; done

# Every library the packed programs, libraries and MPI components load, found with ldd here. Not
# carried: glibc, libstdc++/libgcc_s (the image's are newer), CUDA's (cudart, cuBLAS: the toolkit;
# NCCL: the PyTorch wheel) and our own. fallback/: libraries every image has but this one might not.
SYSTEM='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libutil|libresolv|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libnccl|libbooster_[a-z0-9_]+)\.so'
FALLBACK='^(libz|libgomp|libudev|libatomic|libnuma|libuuid)\.so'
missing=()
while read -r soname path; do
  grep -qE "$SYSTEM" <<<"$soname" && continue
  if [ "$path" = "not" ]; then missing+=("$soname"); continue; fi
  if grep -qE "$FALLBACK" <<<"$soname"; then dst=$STAGE/deps/fallback/$soname; else dst=$STAGE/deps/usr/lib/$ARCH/$soname; fi
  [ -e "$dst" ] || cp -L "$path" "$dst"
done < <(find "$STAGE/build" "$STAGE/deps/usr" -type f \( -name '*.so*' -o -perm -u+x \) -print0 |
         xargs -0 -n 20 ldd 2>/dev/null | awk '$2 == "=>" {print $1, $3}' | sort -u)
[ ${#missing[@]} -eq 0 ] || { echo "gpu_pack: not found here by ldd: ${missing[*]}" >&2; exit 1; }

{
  echo "packed $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname) from $(git rev-parse --short HEAD)" \
       "($(git status --short --untracked-files=no | wc -l) tracked files modified)"
  echo "newest source: ${newest_src#* } $(stamp "${newest_src%% *}"); libbooster_core.so $(stamp "$(stat -c %Y build/lib/libbooster_core.so)")"
  echo "targets: $TARGETS"
  echo "programs: ${bins[*]}"
  echo "deps: $(cd "$STAGE/deps/usr/lib/$ARCH" && ls | tr '\n' ' ')"
  echo "fallback: $(ls "$STAGE/deps/fallback" | tr '\n' ' ')"
} > "$STAGE/MANIFEST.txt"

rm -rf "$DEV" && mkdir -p "$DEV"
tar -C "$STAGE" -cf - build | xz -T2 -6 > "$DEV/build.tar.xz"
tar -C "$STAGE/deps" -cf - . | xz -T2 -6 > "$DEV/deps.tar.xz"
cp "$STAGE/MANIFEST.txt" "$DEV/"
ls -l "$DEV"

# ------------------------------------------------------------------------------------------ size
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null |
             awk '{s += $1} END {print s + 0}')
dev_bytes=$(du -sb "$DEV" | cut -f1)
total=$((tree_bytes + dev_bytes))
awk -v t="$tree_bytes" -v d="$dev_bytes" 'BEGIN {m = 1048576; printf "== carried: tree %.1f MiB + .device %.1f MiB = %.1f MiB (the tool takes 64; we keep under 60)\n", t / m, d / m, (t + d) / m}'
[ "$total" -lt $((60 * 1048576)) ] || { echo "gpu_pack: over 60 MiB" >&2; exit 1; }

# ------------------------------------------------------------------------------------------ verify
# A mount namespace in which this machine looks like the GPU image: no OpenMPI, PMIx, hwloc, libevent,
# OpenBLAS, Boost, SentencePiece, gfortran, munge (overlay whiteouts over their files), no
# libz/libgomp/libudev either (so fallback/ is exercised), and /work hidden (gpu_round.sh links
# /work/main itself). hide_and_run CMD runs CMD in it.
hide_and_run() {
  local ovl=/tmp/gpu_pack_ovl
  rm -rf $ovl && mkdir -p $ovl/lib/u $ovl/lib/w $ovl/bin/u $ovl/bin/w
  local hidden=(openmpi pmix2 hwloc openblas-openmp openblas-pthread blas lapack)
  for so in $(ls "$STAGE/deps/usr/lib/$ARCH" "$STAGE/deps/fallback"); do
    case $so in libbooster*) continue ;; esac
    for f in /usr/lib/$ARCH/${so%%.so*}.so*; do [ -e "$f" ] && hidden+=("${f##*/}"); done
  done
  for f in "${hidden[@]}"; do [ -e "/usr/lib/$ARCH/$f" ] && [ ! -e "$ovl/lib/u/$f" ] && mknod "$ovl/lib/u/$f" c 0 0; done
  for f in mpirun mpiexec orterun orted ompi_info mpirun.openmpi mpiexec.openmpi; do
    [ -e /usr/bin/$f ] || [ -L /usr/bin/$f ] && mknod "$ovl/bin/u/$f" c 0 0
  done
  unshare -m --propagation private bash -c "
    set -e
    mount -t overlay overlay -o lowerdir=/usr/lib/$ARCH,upperdir=$ovl/lib/u,workdir=$ovl/lib/w /usr/lib/$ARCH
    mount -t overlay overlay -o lowerdir=/usr/bin,upperdir=$ovl/bin/u,workdir=$ovl/bin/w /usr/bin
    for d in /etc/openmpi /usr/share/openmpi /work; do mount -t tmpfs tmpfs \$d; done
    $1"
}
if [ "$VERIFY" = 1 ] || [ "$DRY" = 1 ]; then
  V=/tmp/gpu_dry
  rm -rf $V ${V}_out && mkdir -p $V ${V}_out
  # The carried tree: tracked and untracked-not-ignored files, plus .device.
  git ls-files -z --cached --others --exclude-standard |
    tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -C $V -xf -
  cp -a "$DEV" $V/
fi
if [ "$VERIFY" = 1 ]; then
  log "verify: in a namespace without this machine's OpenMPI and Debian-only libraries"
  hide_and_run "
    n=\$(ls /usr/lib/$ARCH/libmpi.so.40 /usr/bin/mpirun /usr/lib/$ARCH/libopenblas.so.0 /usr/lib/$ARCH/libz.so.1 \
          /etc/openmpi/openmpi-mca-params.conf 2>&1 | grep -c 'No such file')
    echo \"hidden: \$n of 5 probes (libmpi, mpirun, libopenblas, libz, /etc/openmpi)\"
    [ \$n = 5 ]
    cd $V && GPU_ROUND_SETUP_ONLY=1 OUT=${V}_out bash bench/gpu_round.sh
    . /tmp/deps/env.sh
    cd /work/main
    echo '== ldd: every library outside build/lib and /tmp/deps'
    ldd build/bin/* build/lib/*.so /tmp/deps/usr/lib/$ARCH/openmpi/lib/openmpi3/*.so /tmp/deps/usr/bin/orterun 2>/dev/null |
      awk '\$2 == \"=>\" {print \$1, \$3}' | grep -vE ' (/tmp/deps/|.*/build/(bin|lib)/)' | sort -u | awk '{printf \"  %s\", \$0} END {print \"\"}'
    if ldd build/bin/* build/lib/*.so /tmp/deps/usr/lib/$ARCH/openmpi/lib/openmpi3/*.so 2>/dev/null | grep 'not found'; then exit 1; fi
    for np in 2 4; do
      echo \"== mpirun -np \$np test_mpi_process_group (smoke)\"
      timeout 120 mpirun \$MPIRUN_ARGS -np \$np build/bin/test_mpi_process_group --use-colour no \
        'mpi group: rank and size*,mpi all_reduce: sum*' 2>&1 |
        grep -E 'passed|failed|rror|not found|WARNING' | sort | uniq -c | head -20
      [ \${PIPESTATUS[0]} = 0 ] || exit 1
    done"
  log "verify: ok"
fi
if [ "$DRY" = 1 ]; then
  log "dry run of bench/gpu_round.sh from $V (no GPU here: the CUDA tests skip), OUT=${V}_out"
  start=$(date +%s)
  hide_and_run "cd $V && OUT=${V}_out DEADLINE=${DEADLINE:-420} bash bench/gpu_round.sh" || true
  log "dry run: $(( $(date +%s) - start )) s; ${V}_out: $(ls ${V}_out | tr '\n' ' ')"
fi
