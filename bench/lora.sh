#!/usr/bin/env bash
# LoRA against full fine-tuning through `booster train` (bench/README.md, "LoRA against full
# fine-tuning"): the example Llama of examples/configs/llama_fortunes.json (hidden 192, 4 layers, vocab
# 2048, tied embeddings) on random tokens, each setting run REPEATS times alternately:
#   bench/lora.sh [STEPS] [REPEATS]       (STEPS: 40, REPEATS: 3)
# Prints one markdown row per setting: median ms per step (train_seconds / steps, which excludes the
# start and the checkpoint), the run's CPU seconds (user + system, start and checkpoint included: less
# moved than wall time by other jobs on a shared machine), the process's peak resident memory
# (getrusage's maxrss, via /usr/bin/time), and the bytes of the last checkpoint's step directory.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-40}; repeats=${2:-3}
work=$(mktemp -d /tmp/booster_bench_lora.XXXXXX)
trap 'rm -rf "$work"' EXIT
python3 - "$work/tokens.bin" <<'EOF'
import random, struct, sys
random.seed(0)
ids = [random.randrange(2048) for _ in range(200_000)]
open(sys.argv[1], "wb").write(struct.pack("<%dH" % len(ids), *ids))
EOF
base=(--config examples/configs/llama_fortunes.json --set data.path="$work/tokens.bin" --set data.val_path=null
      --set train.max_steps="$steps" --set train.eval_every=0 --set train.log_every=1000 --set train.run_dir=null
      --set train.checkpoint_every="$steps" --set train.keep_last=1)
declare -A settings=(
  ["full fp32"]=""
  ["LoRA r 8 q/v fp32"]='lora={"r":8,"alpha":16,"target_modules":["q_proj","v_proj"]}'
  ["full bf16 pure"]='mixed_precision={"name":"bf16","pure":true}'
  ["LoRA r 8 q/v bf16 pure"]='lora={"r":8,"alpha":16,"target_modules":["q_proj","v_proj"]} mixed_precision={"name":"bf16","pure":true}'
)
order=("full fp32" "LoRA r 8 q/v fp32" "full bf16 pure" "LoRA r 8 q/v bf16 pure")
declare -A ms cpu rss bytes
for r in $(seq "$repeats"); do
  for name in "${order[@]}"; do
    sets=(); for s in ${settings[$name]}; do sets+=(--set "$s"); done
    ck="$work/ck_${r}_${name// /_}"; ck=${ck//\//_}; ck="$work/$(basename "$ck")"
    out=$(OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} /usr/bin/time -f 'maxrss_kb %M cpu_s %U %S' build/bin/booster train "${base[@]}" \
          "${sets[@]}" --set train.checkpoint_dir="$ck" 2>"$work/err" | tail -n 1)
    t=$(echo "$out" | grep -o '"train_seconds":[0-9.e+-]*' | cut -d: -f2)
    ms[$name]+="$(echo "1000 * $t / $steps" | bc -l) "
    rss[$name]+="$(sed -n 's/^maxrss_kb \([0-9]*\) .*/\1/p' "$work/err") "
    cpu[$name]+="$(sed -n 's/^maxrss_kb .* cpu_s \([0-9.]*\) \([0-9.]*\)/\1 + \2/p' "$work/err" | bc -l) "
    bytes[$name]=$(du -sb "$ck"/step-* | cut -f1)
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}'; }
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}, $steps steps x $repeats"
echo "| setting | ms per step (median) | CPU s per run (median) | peak RSS MiB (median) | checkpoint bytes |"
echo "|---|---|---|---|---|"
for name in "${order[@]}"; do
  printf '| %s | %.1f | %.1f | %.1f | %s |\n' "$name" "$(echo "${ms[$name]}" | median)" "$(echo "${cpu[$name]}" | median)" \
    "$(echo "$(echo "${rss[$name]}" | median) / 1024" | bc -l)" "${bytes[$name]}"
done
