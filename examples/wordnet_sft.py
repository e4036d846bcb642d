#!/usr/bin/env python3
"""WordNet's glosses as instruction data (examples/README.md, "LoRA on WordNet").

Reads Debian's wordnet-base (/usr/share/wordnet/data.{noun,verb,adj,adv}) and writes JSONL records
{"prompt": "What does \"WORD\" mean?", "response": "DEFINITION"}, one per synset (its first word, its
gloss up to the first quoted example), shuffled with a fixed seed, the last --val records to a second file.

Usage: wordnet_sft.py OUT_TRAIN.jsonl OUT_VAL.jsonl [--records N] [--val N] [--seed S] [--wordnet DIR]
"""
import argparse
import json
import os
import random
import sys


def synsets(path):
    """(word, definition) of each synset line of a WordNet data file (license lines start with spaces)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("  ") or "|" not in line:
                continue
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            # offset lex_filenum ss_type w_cnt(hex) word lex_id ...
            if len(parts) < 6:
                continue
            word = parts[4].replace("_", " ")
            # An adjective's marker: "word(a)", "word(p)", "word(ip)".
            if word.endswith(")") and "(" in word:
                word = word[: word.index("(")]
            definition = gloss.strip().split('; "', 1)[0].strip().rstrip(";").strip()
            if word and definition and not any(c.isdigit() for c in word):
                yield word, definition


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train")
    parser.add_argument("val")
    parser.add_argument("--records", type=int, default=20000, help="training records (0: all)")
    parser.add_argument("--val", dest="val_records", type=int, default=500, help="held-out records")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wordnet", default="/usr/share/wordnet")
    args = parser.parse_args()

    records = []
    for pos in ("noun", "verb", "adj", "adv"):
        path = os.path.join(args.wordnet, "data." + pos)
        if not os.path.exists(path):
            sys.exit(f"wordnet_sft: {path} is missing; install Debian's wordnet-base (bash scripts/setup.sh does)")
        records.extend(synsets(path))
    random.Random(args.seed).shuffle(records)
    val = records[-args.val_records:] if args.val_records > 0 else []
    train = records[: len(records) - len(val)]
    if args.records > 0:
        train = train[: args.records]
    for out, rows in ((args.train, train), (args.val, val)):
        with open(out, "w", encoding="utf-8") as f:
            for word, definition in rows:
                f.write(json.dumps({"prompt": f'What does "{word}" mean?', "response": definition}) + "\n")
    print(f"wordnet: {len(records)} synsets, {len(train)} training records in {args.train}, "
          f"{len(val)} held out in {args.val}")


if __name__ == "__main__":
    main()
