#!/usr/bin/env bash
# Fails when a shared library exports code that needs more than baseline x86-64 outside the per-ISA
# kernel namespaces (Note [CPU kernels per ISA level], Note [One namespace per ISA build]): a global or
# weak function with AVX (ymm), AVX-512 (zmm, mask) registers would be reachable on any CPU, and the
# linker may have kept such a copy of an inline function in place of the portable one.
# usage: check_portable_library.sh lib.so...
set -euo pipefail
status=0
for lib in "$@"; do
  wide=$(mktemp) globals=$(mktemp)
  objdump -d --no-show-raw-insn -C "$lib" | awk '
    /^[0-9a-f]+ <.*>:$/ { fn = $0; sub(/^[0-9a-f]+ </, "", fn); sub(/>:$/, "", fn); next }
    /%[yz]mm[0-9]|\{%k[1-7]\}/ { if (!(fn in seen)) { seen[fn] = 1; print fn } }' |
    grep -v 'isa_avx2\|isa_avx512' | sort -u > "$wide" || true
  nm -C --defined-only "$lib" | awk '$2 ~ /^[TWVui]$/ { $1 = ""; $2 = ""; sub(/^  /, ""); print }' | sort -u > "$globals"
  bad=$(comm -12 "$wide" "$globals")
  total=$(wc -l < "$wide")
  if [ -n "$bad" ]; then
    echo "FAIL $lib: exported functions use AVX/AVX-512 registers outside the per-ISA kernels:"
    echo "$bad" | head -20
    status=1
  else
    echo "ok $lib: $total functions with wide registers, all local to a per-ISA build or dispatched at run time"
  fi
  rm -f "$wide" "$globals"
done
exit $status
