#!/usr/bin/env bash
# Mutation check: applies each deliberate bug of scripts/mutations.txt to the source tree, one at a time,
# rebuilds only the targets it names, runs only the tests it names, and reports whether those tests
# caught it (some test failed) or missed it (all passed). Every mutation must be caught: a miss names
# a test that cannot see that bug. The tree is restored after each mutation, also on Ctrl-C or error,
# and the named targets are rebuilt from the clean tree at the end.
#
# Usage: scripts/mutate.sh [-k] [name-regex]      (from anywhere; the build is in build/)
#   name-regex   run only the mutations whose name matches (grep -E)
#   -k           skip the baseline run of the selected tests on the clean tree
# Exit status: 0 when every selected mutation was caught, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build="$root/build"
list="$root/scripts/mutations.txt"
baseline=1
if [ "${1:-}" = "-k" ]; then baseline=0; shift; fi
select="${1:-.}"
[ -f "$build/build.ninja" ] || { echo "mutate: no build in $build (run scripts/setup.sh first)"; exit 2; }
jobs=${MUTATE_JOBS:-2}

# --- parse the list into parallel arrays (blocks of "key: value" lines, blank-line separated)
names=(); files=(); finds=(); replaces=(); builds=(); tests=()
flush() {
  if [ -n "${name:-}" ]; then
    names+=("$name"); files+=("$file"); finds+=("$find"); replaces+=("$replace"); builds+=("$targets"); tests+=("$test")
  fi
  name=; file=; find=; replace=; targets=; test=; key=
}
flush
while IFS= read -r line || [ -n "$line" ]; do
  case "$line" in
    '#'*) continue ;;
    '') flush; continue ;;
  esac
  if [[ "$line" =~ ^(name|file|find|replace|build|test):[[:space:]]*(.*)$ ]]; then
    key=${BASH_REMATCH[1]}; value=${BASH_REMATCH[2]}
    case $key in
      name) name=$value ;; file) file=$value ;; find) find=$value ;; replace) replace=$value ;;
      build) targets=$value ;; test) test=$value ;;
    esac
  else  # a continuation line belongs to the last find/replace (multi-line fragments)
    case $key in
      find) find+=$'\n'$line ;; replace) replace+=$'\n'$line ;;
      *) echo "mutate: cannot read line: $line"; exit 2 ;;
    esac
  fi
done < "$list"
flush

# --- restore on any exit
backup=$(mktemp -d)
current=
restore() {
  if [ -n "$current" ] && [ -f "$backup/original" ]; then
    # A plain copy, so the restored file is newer than the mutated objects and ninja rebuilds them
    # (cp -p would keep the old time, and ninja would keep the mutated library).
    cp "$backup/original" "$root/$current"
    current=
  fi
}
all_targets=()
finish() {
  restore
  rm -rf "$backup"
}
trap finish EXIT
trap 'echo; echo "mutate: interrupted; the tree is restored (rebuild with: ninja -C build ${all_targets[*]})"; exit 130' INT TERM

run_tests() {  # $1 = ctest regex; output to $2; returns ctest's status
  (cd "$build" && ctest -R "$1" --no-tests=error -j "$jobs" --timeout 600 > "$2" 2>&1)
}

selected=()
for i in "${!names[@]}"; do
  if printf '%s' "${names[$i]}" | grep -Eq -- "$select"; then selected+=("$i"); fi
done
[ ${#selected[@]} -gt 0 ] || { echo "mutate: no mutation matches '$select'"; exit 2; }
for i in "${selected[@]}"; do for t in ${builds[$i]}; do
  [[ " ${all_targets[*]} " == *" $t "* ]] || all_targets+=("$t")
done; done

echo "mutate: building ${all_targets[*]}"
ninja -C "$build" -j "$jobs" "${all_targets[@]}" > "$backup/build.log" 2>&1 || { cat "$backup/build.log"; exit 2; }
if ((baseline)); then
  for i in "${selected[@]}"; do
    if ! run_tests "${tests[$i]}" "$backup/base.log"; then
      echo "mutate: the clean tree fails the tests of '${names[$i]}' (ctest -R '${tests[$i]}'):"
      tail -20 "$backup/base.log"; exit 2
    fi
  done
  echo "mutate: the clean tree passes every selected test"
fi

caught=0; missed=0; broken=0
printf '%-8s %s\n' result mutation
for i in "${selected[@]}"; do
  file=${files[$i]}
  cp "$root/$file" "$backup/original"
  current=$file
  if ! FIND=${finds[$i]} REPLACE=${replaces[$i]} perl -0pi -e '
        my $n = () = /\Q$ENV{FIND}\E/g;
        die "found $n times, not once\n" if $n != 1;
        s/\Q$ENV{FIND}\E/$ENV{REPLACE}/;' "$root/$file" 2> "$backup/perl.log"; then
    printf '%-8s %s (%s: %s)\n' BROKEN "${names[$i]}" "$file" "$(cat "$backup/perl.log")"
    broken=$((broken + 1)); restore; continue
  fi
  if ! ninja -C "$build" -j "$jobs" ${builds[$i]} > "$backup/build.log" 2>&1; then
    printf '%-8s %s (does not compile: see below)\n' BROKEN "${names[$i]}"
    grep -m5 -E "error" "$backup/build.log"
    broken=$((broken + 1)); restore; continue
  fi
  if run_tests "${tests[$i]}" "$backup/test.log"; then
    printf '%-8s %s   [ctest -R "%s"]\n' MISSED "${names[$i]}" "${tests[$i]}"
    missed=$((missed + 1))
  else
    failed=$(grep -cE '\*\*\*(Failed|Timeout|Exception)|\(Failed\)' "$backup/test.log")
    printf '%-8s %s   [%s]\n' caught "${names[$i]}" "$(grep -E 'tests passed, [0-9]+ tests failed' "$backup/test.log")"
    caught=$((caught + 1))
  fi
  restore
done

echo "mutate: rebuilding ${all_targets[*]} from the clean tree"
ninja -C "$build" -j "$jobs" "${all_targets[@]}" > "$backup/build.log" 2>&1 || { cat "$backup/build.log"; exit 2; }
echo "mutate: ${#selected[@]} mutations: $caught caught, $missed missed, $broken broken"
[ $missed -eq 0 ] && [ $broken -eq 0 ]
