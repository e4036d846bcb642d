#!/usr/bin/env bash
# One device-tool round for the GPU work, with nothing compiled on the device: bench/gpu_pack.sh built
# the CUDA targets here and packed them, with the runtime the GPU image lacks (OpenBLAS, Boost,
# SentencePiece, Debian 12's OpenMPI relocated through OPAL_PREFIX), into the ignored .device/. This
# unpacks it (build/ into the repo root, the runtime to /tmp/deps, /work/main linked to the repo root,
# where the binaries look for fixtures and build/), then runs, each step under a timeout and all of it
# within DEADLINE seconds (420):
#   a. every build/bin/test_cuda_* (TEST_JOBS=3 at a time, 120 s each);
#   b. test_mpi_cuda, when packed, under `mpirun -np 2`, then -np 4 "[hybrid]" (150 s each), after a
#      two-rank smoke test of the launcher (test_mpi_process_group); then on 2 processes started with
#      torchrun's variables, no mpirun (the tcp group, staged onto the GPU; 120 s);
#   c. GPT-2-small (bench_gpt2_cuda): bf16 at batch 8 with the doctor's tracer off, nonfinite, stats
#      and off again (the overhead of naming the first inf/NaN tensor and of per-module statistics),
#      fp32 (TF32) and fp8 at batch 8, bf16 at 16 and 32; PyTorch eager with SDPA (fp32, fp16, bf16 at
#      batch 8, bf16 at 16 and 32) on the same GPU. (No Llama: bench_llama has no CUDA mode.)
# $OUT (/tmp/out) gets summary.txt (printed last), setup.log, tests.log, mpi.log, bench.jsonl, bench.log.
#
#   bash bench/gpu_pack.sh          # here, first; the device call carries [".device"]
#   bash bench/gpu_round.sh         # on the GPU machine, from the repo root
#   SKIP_TESTS=1 SKIP_MPI=1 SKIP_BENCH=1 TORCH=0 TESTS="test_cuda_ops" STEPS=6 WARMUP=2 bash bench/gpu_round.sh
# GPU_ROUND_SETUP_ONLY=1 unpacks and writes /tmp/deps/env.sh (the environment, to source) and stops.
# When something must be compiled on the device after all: bench/cuda_device_run.sh (carries .devdeps).
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out}
DEADLINE=${DEADLINE:-420}
D=/tmp/deps
L=$D/usr/lib/x86_64-linux-gnu
ROOT=$PWD
LOGS=$(mktemp -d /tmp/gpu_round.XXXXXX)
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
note() { echo "$*" >> "$SUMMARY"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
# budget NOMINAL RESERVE: a step's timeout, NOMINAL or what the deadline leaves after RESERVE seconds.
budget() { local b=$(( $(left) - $2 )); (( b > $1 )) && b=$1; echo $b; }
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }

# ------------------------------------------------------------------------------------------ setup
setup() {
  [ -f .device/build.tar.xz ] && [ -f .device/deps.tar.xz ] ||
    { echo "gpu_round: no .device/{build,deps}.tar.xz: run bench/gpu_pack.sh first and carry .device"; return 1; }
  xz -dc .device/build.tar.xz | tar -xf - || return 1
  rm -rf $D && mkdir -p $D && { xz -dc .device/deps.tar.xz | tar -C $D -xf - || return 1; }
  if [ "$ROOT" != /work/main ]; then
    if [ -e /work/main ] && [ ! -L /work/main ]; then
      echo "gpu_round: warning: /work/main is a real directory: the tests' fixture paths point there"
    else
      mkdir -p /work && ln -sfn "$ROOT" /work/main
    fi
  fi
  local orig=${LD_LIBRARY_PATH:-}
  # fallback/: libraries (libz, libgomp, libudev) used only where the image has none.
  local f n p used=""
  for f in $D/fallback/*; do
    [ -e "$f" ] || continue
    n=${f##*/}
    for p in $(ldconfig -p 2>/dev/null | awk -v n="$n" '$1 == n {print $NF}') /usr/lib/x86_64-linux-gnu/$n /lib/x86_64-linux-gnu/$n ""; do
      [ -n "$p" ] && [ -e "$p" ] && break
    done
    [ -z "$p" ] && ln -sf "$f" "$L/$n" && used+="$n "
  done
  echo "fallback libraries used: ${used:-none}"
  # NCCL from PyTorch's wheel (as bench/cuda_device_run.sh finds it); CUDA's libraries from the toolkit.
  local nccl
  nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null)
  [ -z "$nccl" ] && nccl=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)
  echo "NCCL_DIR=${nccl:-not found}"
  local ld=$L:$L/openmpi/lib:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib
  [ -n "$nccl" ] && ld+=:$nccl/lib
  export LD_LIBRARY_PATH=$ld${orig:+:$orig}
  # Anything still unresolved (a CUDA library outside the toolkit's lib64): look in the Python wheels.
  local m dir site
  site=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
  for m in $(ldd build/lib/*.so build/bin/* 2>/dev/null | awk '$3 == "not" {print $1}' | sort -u); do
    dir=$(find $site /usr/local/cuda/ -maxdepth 5 -name "$m" 2>/dev/null | head -1)
    if [ -n "$dir" ]; then echo "found $m in ${dir%/*}"; LD_LIBRARY_PATH+=:${dir%/*}; else echo "gpu_round: $m not found anywhere"; fi
  done
  {
    printf 'export ORIG_LD_LIBRARY_PATH=%q\n' "$orig"
    printf 'export LD_LIBRARY_PATH=%q\n' "$LD_LIBRARY_PATH"
    printf 'export PATH=%q\n' "$D/usr/bin:/usr/local/cuda/bin:$PATH"
    # Debian's OpenMPI, moved: every prefix-relative directory follows OPAL_PREFIX; its sysconfdir
    # (/etc/openmpi) and PMIx's (with an absolute component path in its params file) are named too.
    echo "export OPAL_PREFIX=$D/usr OPAL_SYSCONFDIR=$D/etc/openmpi"
    echo "export PMIX_PREFIX=$L/pmix2 PMIX_MCA_mca_base_component_path=$L/pmix2/lib/pmix"
    echo "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
    # One machine: shared memory only (no CMA/ptrace single copy inside a VM), no fabrics.
    echo "export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none"
    echo "export OMPI_MCA_btl_base_warn_component_unused=0 OMPI_MCA_mca_base_component_show_load_errors=0"
    echo "export MPIRUN_ARGS='--oversubscribe --bind-to none'"
  } > $D/env.sh
  . $D/env.sh
  ldd build/lib/libbooster_core.so | awk '{printf "  %s %s\n", $1, $3}' | grep -vE '^  (linux-vdso|/lib64)'
  ldd build/lib/*.so build/bin/* 2>/dev/null | grep -q 'not found' && { echo "gpu_round: unresolved libraries:"; ldd build/bin/* build/lib/*.so | grep 'not found' | sort -u; }
  echo "mpirun: $(command -v mpirun) ($(mpirun --version 2>&1 | head -1))"
}

setup > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
[ "${GPU_ROUND_SETUP_ONLY:-0}" = 1 ] && { cat "$OUT/setup.log"; exit 0; }
. $D/env.sh
grep -E 'not found|warning' "$OUT/setup.log" | head -5 >> "$SUMMARY"
{
  head -3 .device/MANIFEST.txt
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi -L 2>&1 | head -4
    nvidia-smi --query-gpu=driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 | head -1 |
      sed 's/^/driver, memory, compute capability: /'
    nvidia-smi 2>/dev/null | grep -m1 -o 'CUDA Version: [0-9.]*'
  else
    echo "no nvidia-smi"
  fi
  echo "$(nproc) CPUs; /dev/shm $(df -h /dev/shm 2>/dev/null | awk 'NR == 2 {print $2}'); $(python3 -c 'import torch; print("torch", torch.__version__)' 2>/dev/null)"
} | tee -a "$SUMMARY" "$OUT/setup.log"

# A Catch2 log's failures, each under its test case (and sections), FAIL_LINES lines in all.
FAIL_LEFT=${FAIL_LINES:-40}
failures() {  # LOG LABEL
  (( FAIL_LEFT > 0 )) || return 0
  local text
  text=$(awk -v label="$2" '
    /^-+$/ && length($0) > 70 { if (hdr) { hdr = 0 } else { hdr = 1; name = "" }; next }
    hdr { sub(/^ +/, ""); name = name (name == "" ? "" : " / ") $0; next }
    /FAILED:|unexpected exception|fatal error condition|failed with/ {
      if (name != shown) { print label ": " name; shown = name }
      print "  " $0; n = 5; next }
    NF == 0 { n = 0 }
    n > 0 { print "  " $0; n-- }' "$1" | cut -c1-200 | head -"$FAIL_LEFT")
  [ -n "$text" ] || return 0
  echo "$text" >> "$SUMMARY"
  FAIL_LEFT=$(( FAIL_LEFT - $(wc -l <<<"$text") ))
}
result_line() {  # LOG: Catch2's totals, and how many tests skipped
  local r s
  r=$(grep -E '^(test cases:|All tests passed|No tests ran)' "$1" | tr '\n' ' ' | tr -s ' ' | sed 's/ $//')
  [ -n "$r" ] || r="no Catch2 totals: $(tail -2 "$1" | tr '\n' ' ' | cut -c1-150)"
  s=$(grep -c BOOSTER_TEST_SKIPPED "$1")
  [ "$s" != 0 ] && r+=" ($s skipped)"
  echo "$r"
}

# ------------------------------------------------------------------------------------------ a. tests
RESERVE=$(( (${SKIP_MPI:-0} == 1 ? 0 : 100) + (${SKIP_BENCH:-0} == 1 ? 0 : 150) ))
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== CUDA tests ($(elapsed))"
  note "== CUDA tests"
  tests=${TESTS:-$(cd build/bin && ls test_cuda_* 2>/dev/null)}
  for t in $tests; do
    while (( $(jobs -rp | wc -l) >= ${TEST_JOBS:-3} )); do wait -n; done
    to=$(budget 120 $RESERVE)
    if (( to < 15 )); then echo "skipped: out of time" > $LOGS/$t.log; echo "- -" > $LOGS/$t.rc; continue; fi
    (
      s=$(date +%s)
      OMP_NUM_THREADS=${TEST_THREADS:-4} OMP_WAIT_POLICY=passive timeout -k 5 $to build/bin/$t --use-colour no > $LOGS/$t.log 2>&1
      echo "$? $(( $(date +%s) - s ))" > $LOGS/$t.rc
    ) &
  done
  wait
  : > "$OUT/tests.log"
  for t in $tests; do
    read -r rc secs < $LOGS/$t.rc
    { echo "######## $t rc=$rc ${secs}s"; cat $LOGS/$t.log; } >> "$OUT/tests.log"
    line="$t rc=$rc ${secs}s: $(result_line $LOGS/$t.log)"
    echo "$line" | cut -c1-200; note "$line"
    [ "$rc" = 0 ] || failures $LOGS/$t.log $t
  done
  [ -f $LOGS/test_cuda_attention.log ] && grep -E '^(flash|unfused) ' $LOGS/test_cuda_attention.log | head -12 >> "$SUMMARY"
fi

# ------------------------------------------------------------------------------------------ b. mpi
mpi_step() {  # NAME NOMINAL NP ARGS...: one mpirun, tagged output appended to mpi.log
  local name=$1 nominal=$2 np=$3; shift 3
  local to; to=$(budget $nominal $(( ${SKIP_BENCH:-0} == 1 ? 0 : 150 )))
  if (( to < 20 )); then note "$name: skipped, out of time"; return; fi
  local s; s=$(date +%s)
  echo "######## $name: mpirun -np $np $*" >> "$OUT/mpi.log"
  OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=1 timeout -k 10 $to mpirun $MPIRUN_ARGS --tag-output -np $np "$@" > $LOGS/mpi.out 2>&1
  local rc=$?
  cat $LOGS/mpi.out >> "$OUT/mpi.log"
  local line="$name (np $np) rc=$rc $(( $(date +%s) - s ))s:"
  local r
  for r in $(seq 0 $((np - 1))); do
    sed -n "s/^\[1,$r\]<std[a-z]*>://p" $LOGS/mpi.out > $LOGS/mpi.$r
    line+=" [$r] $(result_line $LOGS/mpi.$r)"
  done
  echo "$line" | cut -c1-300; note "$line"
  if [ "$rc" != 0 ]; then
    grep -v '^\[1,' $LOGS/mpi.out | grep -vE '^\s*$' | head -6 >> "$SUMMARY"  # mpirun's own complaints
    for r in $(seq 0 $((np - 1))); do grep -q '^All tests passed' $LOGS/mpi.$r || failures $LOGS/mpi.$r "$name[$r]"; done
  fi
}
env_step() {  # NAME NOMINAL NP ARGS...: NP processes started with torchrun's variables (the tcp group)
  local name=$1 nominal=$2 np=$3; shift 3
  local to; to=$(budget $nominal $(( ${SKIP_BENCH:-0} == 1 ? 0 : 150 )))
  if (( to < 20 )); then note "$name: skipped, out of time"; return; fi
  local s r rc=0 port=$((29000 + RANDOM % 1000)); s=$(date +%s)
  echo "######## $name: $np processes, WORLD_SIZE=$np MASTER_ADDR=127.0.0.1 MASTER_PORT=$port $*" >> "$OUT/mpi.log"
  local pids=()
  for r in $(seq 0 $((np - 1))); do
    env -u OMPI_COMM_WORLD_SIZE -u PMIX_RANK -u PMI_SIZE -u PMI_RANK WORLD_SIZE=$np RANK=$r LOCAL_RANK=$r \
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=1 \
      timeout -k 10 $to "$@" > $LOGS/env.$r 2>&1 &
    pids+=($!)
  done
  for r in $(seq 0 $((np - 1))); do wait ${pids[$r]} || rc=$?; done
  local line="$name (np $np) rc=$rc $(( $(date +%s) - s ))s:"
  for r in $(seq 0 $((np - 1))); do
    { echo "---- rank $r"; cat $LOGS/env.$r; } >> "$OUT/mpi.log"
    line+=" [$r] $(result_line $LOGS/env.$r)"
  done
  echo "$line" | cut -c1-300; note "$line"
  if [ "$rc" != 0 ]; then
    for r in $(seq 0 $((np - 1))); do grep -q '^All tests passed' $LOGS/env.$r || failures $LOGS/env.$r "$name[$r]"; done
  fi
}
if [ "${SKIP_MPI:-0}" != 1 ]; then
  echo "== MPI ($(elapsed))"
  note "== MPI"
  : > "$OUT/mpi.log"
  [ -x build/bin/test_mpi_process_group ] && mpi_step "launcher smoke test_mpi_process_group" 60 2 \
    build/bin/test_mpi_process_group --use-colour no "mpi group: rank and size*,mpi all_reduce: sum*"
  if [ -x build/bin/test_mpi_cuda ]; then
    mpi_step test_mpi_cuda 150 2 build/bin/test_mpi_cuda --use-colour no
    mpi_step "test_mpi_cuda [hybrid]" 150 4 build/bin/test_mpi_cuda --use-colour no "[hybrid]"
    env_step "test_mpi_cuda over tcp" 120 2 build/bin/test_mpi_cuda --use-colour no
  else
    note "no build/bin/test_mpi_cuda in the pack"
  fi
fi

# ------------------------------------------------------------------------------------------ c. bench
bench() {  # NOMINAL CMD...: JSON lines to bench.jsonl, everything to bench.log
  local nominal=$1; shift
  local to; to=$(budget $nominal 5)
  if (( to < 20 )); then note "skipped, out of time: $*"; return; fi
  local s; s=$(date +%s)
  echo "######## $*" >> "$OUT/bench.log"
  timeout -k 5 $to "$@" > $LOGS/bench.out 2> $LOGS/bench.err
  local rc=$?
  cat $LOGS/bench.out $LOGS/bench.err >> "$OUT/bench.log"
  grep '^{' $LOGS/bench.out >> "$OUT/bench.jsonl"
  echo "rc=$rc $(( $(date +%s) - s ))s: $*" | cut -c1-160
  [ "$rc" = 0 ] || { note "rc=$rc: $*"; tail -3 $LOGS/bench.err | cut -c1-200 >> "$SUMMARY"; }
}
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== benchmarks ($(elapsed))"
  : > "$OUT/bench.log"; : > "$OUT/bench.jsonl"
  B="--steps ${STEPS:-6} --warmup ${WARMUP:-2}"
  export OMP_NUM_THREADS=8
  bench 90 build/bin/bench_gpt2_cuda --batch 8 $B --precision bf16 --trace off,nonfinite,stats,off
  bench 90 build/bin/bench_gpt2_cuda --batch 8 $B --precision fp32,fp8
  bench 60 build/bin/bench_gpt2_cuda --batch 16 $B --precision bf16
  bench 60 build/bin/bench_gpt2_cuda --batch 32 $B --precision bf16
  if [ "${TORCH:-1}" != 0 ]; then
    # PyTorch with the image's own libraries (none of /tmp/deps).
    bench 120 env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" python3 bench/torch_gpt2_cuda.py --batch 8 $B --precision all
    bench 60 env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" python3 bench/torch_gpt2_cuda.py --batch 16 $B --precision bf16
    bench 60 env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" python3 bench/torch_gpt2_cuda.py --batch 32 $B --precision bf16
  fi
  note "== GPT-2-small ($B)"
  LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" python3 - "$OUT/bench.jsonl" >> "$SUMMARY" 2>&1 <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
heads = [r for r in rows if "framework" not in r]
if heads:
    peaks = lambda who: "/".join("%.0f" % r.get("bf16_gemm_peak_tflops", 0) for r in heads if ("torch" in r) == (who == "torch"))
    print("device: %s; %s; bf16 GEMM peak TFLOP/s, booster %s, torch %s" % (
        ", ".join(sorted({r.get("device", "?") for r in heads})),
        ", ".join(sorted({"torch " + r["torch"] for r in heads if "torch" in r})) or "no torch", peaks("booster"), peaks("torch")))
print("%-8s %-10s %5s %-9s %9s %10s %6s %8s %s" % ("who", "precision", "batch", "trace", "ms/step", "tokens/s", "MFU", "peak GiB", "fwd/bwd/upd ms"))
base = {}
for r in rows:
    if "framework" not in r:
        continue
    ph = r.get("phase_ms", {})
    print("%-8s %-10s %5d %-9s %9.2f %10.0f %5.1f%% %8.1f %s" % (
        r["framework"], r["precision"], r["batch"], r.get("trace", r.get("attention", "")), r["ms_per_step"],
        r["tokens_per_s"], 100 * r["mfu_vs_bf16_gemm"], r.get("peak_mem_gib", 0),
        "/".join("%.1f" % ph[k] for k in ("forward", "backward", "update")) if ph else ""))
    if r.get("first_nonfinite"):
        print("   first non-finite tensor:", r["first_nonfinite"])
trace = [r for r in rows if r.get("framework") == "booster" and r["batch"] == 8 and r["precision"] == "bf16" and "trace" in r]
off = [r["ms_per_step"] for r in trace if r["trace"] == "off"]
if off:
    ref = sum(off) / len(off)
    print("tracer overhead, bf16 batch 8 (vs the mean of the off runs, %s ms):" % "/".join("%.2f" % x for x in off),
          ", ".join("%s %+.1f%%" % (r["trace"], 100 * (r["ms_per_step"] / ref - 1)) for r in trace if r["trace"] != "off"))
for b in sorted({r["batch"] for r in rows if "framework" in r}):
    for p in ("bf16", "fp32"):
        bo = [r for r in rows if r.get("framework") == "booster" and r["batch"] == b and r["precision"] == p and r.get("trace", "off") == "off"]
        to = [r for r in rows if r.get("framework") == "torch" and r["batch"] == b and r["precision"] == p]
        if bo and to:
            print("batch %d %s: booster / PyTorch tokens/s = %.2f" % (b, p, bo[0]["tokens_per_s"] / to[0]["tokens_per_s"]))
EOF
fi

echo "== done in $(elapsed); files in $OUT: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$SUMMARY"
echo
echo "################################ summary"
cat "$SUMMARY"
rm -rf "$LOGS"
exit 0
