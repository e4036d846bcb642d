#!/usr/bin/env bash
# A small Llama trained offline on the CPU, end to end (examples/README.md, "A Llama on fortunes"):
#   1. a corpus Debian ships: the fortune cookies of the `fortunes` package (/usr/share/games/fortunes/);
#   2. a SentencePiece BPE tokenizer trained on it with spm_train (Debian's `sentencepiece`);
#   3. `booster tokenize`: train and validation token files (the last 5% of the tokens);
#   4. `booster train` with examples/configs/llama_fortunes.json: a 2.0M-parameter Llama (4 layers,
#      width 192, grouped-query heads 4/2, tied embeddings), val_loss and val_ppl every 200 steps;
#   5. `booster generate`: samples from the last checkpoint.
# Usage: bash examples/llama_fortunes.sh [OUT_DIR] [--set key=value ...]   (OUT_DIR: runs/llama_fortunes)
# Needs: bash scripts/setup.sh (the build, sentencepiece and fortunes). Takes a few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/llama_fortunes}
shift || true
booster=build/bin/booster
fortunes=/usr/share/games/fortunes
if ! ls "$fortunes"/* >/dev/null 2>&1; then
  echo "llama_fortunes: no fortunes in $fortunes; install Debian's fortunes package (bash scripts/setup.sh does)" >&2
  exit 1
fi
command -v spm_train >/dev/null || { echo "llama_fortunes: spm_train missing; apt-get install sentencepiece" >&2; exit 1; }
mkdir -p "$out/data"

# 1. The corpus: every fortune file (not the .dat indexes, not the .u8 links), without the % separators.
find "$fortunes" -maxdepth 1 -type f ! -name '*.dat' -print0 | sort -z | xargs -0 cat | grep -v '^%$' > "$out/data/fortunes.txt"
echo "corpus: $(wc -l < "$out/data/fortunes.txt") lines, $(wc -c < "$out/data/fortunes.txt") bytes"

# 2. A 2048-piece BPE model (deterministic: no sampling of the sentences, one thread).
spm_train --input="$out/data/fortunes.txt" --model_prefix="$out/data/tok" --vocab_size=2048 --model_type=bpe \
  --character_coverage=1.0 --num_threads=1 --minloglevel=2 > "$out/data/spm_train.log" 2>&1

# 3. Token files: train.bin and train.val.bin (the last 5%).
"$booster" tokenize --model "$out/data/tok.model" --in "$out/data/fortunes.txt" --out "$out/data/train.bin" \
  --val-fraction 0.05

# 4. Training (progress on stderr; metrics in $out/train/metrics.jsonl).
"$booster" train --config examples/configs/llama_fortunes.json \
  --set data.path="\"$out/data/train.bin\"" --set data.val_path="\"$out/data/train.val.bin\"" \
  --set train.run_dir="\"$out/train\"" "$@"
grep '"val_ppl"' "$out/train/metrics.jsonl" | sed 's/^/eval: /'

# 5. Samples at temperature 0.8 with top-k 50 and top-p 0.95, going on past line ends (</s>), then greedy.
for prompt in "The" "A computer" "Love is"; do
  echo "--- sample: $prompt"
  "$booster" generate --checkpoint "$out/train/checkpoints" --tokenizer "$out/data/tok.model" --prompt "$prompt" \
    --max-new-tokens 60 --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1 --ignore-eos
done
echo "--- greedy: The"
"$booster" generate --checkpoint "$out/train/checkpoints" --tokenizer "$out/data/tok.model" --prompt "The" \
  --max-new-tokens 30 --temperature 0
