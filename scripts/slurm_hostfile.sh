#!/usr/bin/env bash
# Prints an OpenMPI hostfile (`HOST slots=N` a line) for the Slurm allocation this runs in, from
# SLURM_JOB_NODELIST (e.g. node[01-03,07],gpu5) and SLURM_TASKS_PER_NODE (e.g. 2(x3),1,4), so that
#   scripts/slurm_hostfile.sh > hosts.$SLURM_JOB_ID
#   booster run -n "$SLURM_NTASKS" --hostfile hosts.$SLURM_JOB_ID -- booster train --config FILE
# starts one process per task Slurm gave (README.md, "Slurm"). The node list is expanded here, as
# `scontrol show hostnames` would, so the script needs nothing of Slurm's but its variables.
# Exit status 2, with a line on stderr, when a variable is missing or the two do not match.
set -euo pipefail

die() {
  echo "slurm_hostfile.sh: error: $*" >&2
  exit 2
}

case "${1:-}" in
  -h | --help)
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  "") ;;
  *) die "unknown argument '$1'; it takes none (it reads SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE)" ;;
esac

nodelist="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}"
tasks="${SLURM_TASKS_PER_NODE:-}"
[[ -n "$nodelist" ]] || die "SLURM_JOB_NODELIST is not set; run this inside an allocation (salloc, sbatch)"
[[ -n "$tasks" ]] || die "SLURM_TASKS_PER_NODE is not set; run this inside an allocation (salloc, sbatch)"

# Splits "$1" at the commas outside brackets, one item a line.
split_top() {
  local text="$1" item="" depth=0 c i
  for ((i = 0; i < ${#text}; i++)); do
    c="${text:i:1}"
    case "$c" in
      "[") depth=$((depth + 1)) ;;
      "]") depth=$((depth - 1)) ;;
    esac
    if [[ "$c" == "," && $depth -eq 0 ]]; then
      printf '%s\n' "$item"
      item=""
    else
      item+="$c"
    fi
  done
  ((depth == 0)) || die "SLURM_JOB_NODELIST '$nodelist' has an unclosed '['"
  printf '%s\n' "$item"
}

# The host names of one item, e.g. rack[1-2]-n[01,03] (the first bracket group, then the rest, in turn).
expand() {
  local item="$1"
  if [[ "$item" != *"["* ]]; then
    [[ -n "$item" && "$item" != *"]"* ]] || die "SLURM_JOB_NODELIST '$nodelist' is malformed near '$item'"
    printf '%s\n' "$item"
    return
  fi
  local prefix="${item%%\[*}" rest="${item#*\[}"
  [[ "$rest" == *"]"* ]] || die "SLURM_JOB_NODELIST '$nodelist' has an unclosed '['"
  local inner="${rest%%\]*}" suffix="${rest#*\]}" part lo hi n
  IFS=, read -r -a parts <<<"$inner"
  for part in "${parts[@]}"; do
    if [[ "$part" =~ ^([0-9]+)-([0-9]+)$ ]]; then
      lo="${BASH_REMATCH[1]}" hi="${BASH_REMATCH[2]}"
      ((10#$lo <= 10#$hi)) || die "SLURM_JOB_NODELIST '$nodelist' has the range $part, which runs backwards"
      for ((n = 10#$lo; n <= 10#$hi; n++)); do expand "$prefix$(printf '%0*d' "${#lo}" "$n")$suffix"; done
    elif [[ "$part" =~ ^[0-9]+$ ]]; then
      expand "$prefix$part$suffix"
    else
      die "SLURM_JOB_NODELIST '$nodelist' has '$part' in brackets; expected numbers and ranges (01-04)"
    fi
  done
}

# (Each in a subshell, whose die ends only that: its status ends this script too.)
hosts=()
items_text="$(split_top "$nodelist")" || exit 2
mapfile -t items <<<"$items_text"
for item in "${items[@]}"; do
  expanded="$(expand "$item")" || exit 2
  mapfile -t more <<<"$expanded"
  hosts+=("${more[@]}")
done

# SLURM_TASKS_PER_NODE: counts in node order, N(xK) meaning N on each of K nodes.
counts=()
IFS=, read -r -a groups <<<"$tasks"
for group in "${groups[@]}"; do
  if [[ "$group" =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
    for ((k = 0; k < BASH_REMATCH[2]; k++)); do counts+=("${BASH_REMATCH[1]}"); done
  elif [[ "$group" =~ ^[0-9]+$ ]]; then
    counts+=("$group")
  else
    die "SLURM_TASKS_PER_NODE '$tasks' has '$group'; expected counts like 2(x3),1"
  fi
done

((${#counts[@]} == ${#hosts[@]})) ||
  die "SLURM_TASKS_PER_NODE '$tasks' gives ${#counts[@]} node(s) but SLURM_JOB_NODELIST '$nodelist' lists ${#hosts[@]}"
for ((i = 0; i < ${#hosts[@]}; i++)); do
  ((counts[i] > 0)) || continue  # a node with no task of this job
  printf '%s slots=%s\n' "${hosts[i]}" "${counts[i]}"
done
