#!/bin/bash
# Step time of `booster train` with and without train.reproducible (Note [Reproducible training across
# world sizes] in core/booster/booster/reproducible.h), on 1 process and on 2 (ddp), for the GPT and the
# Llama on the same global batch of 32 sequences of 64 bytes. Each setting runs REPEATS times, the
# settings interleaved, and the minimum and the median ms/step of each are printed: on a shared machine
# the minimum is the least disturbed; a run that failed counts as nan. Usage:
#   bash bench/reproducible.sh [REPEATS] [STEPS]
# BOOSTER=path/to/bin/booster times another build (a copy taken while nobody rebuilds build/).
set -uo pipefail
repeats=${1:-5}
steps=${2:-20}
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BOOSTER:-$root/build/bin/booster}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/booster_reproducible_bench.XXXXXX)
trap 'rm -rf "$work"' EXIT
common='"optimizer": {"type": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1},
  "criterion": {"type": "cross_entropy"},
  "data": {"type": "text", "path": "/usr/share/common-licenses/GPL-3", "context": 64, "batch_size": 32, "drop_last": true},
  "train": {"epochs": 1, "log_every": 1000, "eval_every": 0, "seed": 0, "run_dir": null}'
cat >"$work/gpt.json" <<JSON
{"model": {"type": "gpt", "vocab_size": 256, "context": 64, "width": 128, "layers": 2, "heads": 4, "dropout": 0.0},
 $common}
JSON
cat >"$work/llama.json" <<JSON
{"model": {"type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
 $common}
JSON
ms() { python3 -c 'import json,sys
lines=[l for l in sys.stdin.read().splitlines() if l.startswith("{")]
d=json.loads(lines[-1]) if lines else None
print("%.1f" % (d["train_seconds"]/d["steps"]*1000) if d else "nan")'; }
declare -A times
for rep in $(seq "$repeats"); do
  for model in gpt llama; do
    for mode in default k2 k8; do
      case $mode in
        default) set=(--set train.reproducible=false) ;;
        k2) set=(--set train.reproducible=true --set train.reproducible_chunks=2) ;;
        k8) set=(--set train.reproducible=true --set train.reproducible_chunks=8) ;;
      esac
      t1=$("$bin" train --config "$work/$model.json" --set plugin=single --set train.max_steps="$steps" "${set[@]}" 2>/dev/null | ms)
      t2=$(mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" train --config "$work/$model.json" --set plugin=ddp \
             --set data.batch_size=16 --set train.max_steps="$steps" "${set[@]}" 2>/dev/null | ms)
      times[$model,$mode,1]+="$t1 "
      times[$model,$mode,2]+="$t2 "
    done
  done
done
echo "ms/step (min / median of $repeats runs of $steps steps), global batch 32 x 64 tokens, $(nproc --all) cores"
printf "%-6s %-9s %-22s %-22s\n" model mode "1 process" "2 processes (ddp)"
for model in gpt llama; do
  for mode in default k2 k8; do
    stats() { python3 -c "import sys,math,statistics as s; v=sorted(float(x) for x in sys.argv[1:] if not math.isnan(float(x))); print('%.1f / %.1f' % (v[0], s.median(v)) if v else 'failed')" $1; }
    printf "%-6s %-9s %-22s %-22s\n" "$model" "$mode" "$(stats "${times[$model,$mode,1]}")" "$(stats "${times[$model,$mode,2]}")"
  done
done
