#!/usr/bin/env bash
# Lists, under ctest's summary, every test of the last run that was skipped and why (CTest prints the
# names of skipped tests but not their output). Run by ctest itself as CTEST_CUSTOM_POST_TEST (see
# tests/CMakeLists.txt); reads the outputs CTest kept of this run: LastTest.log.tmp while ctest is still
# running (it becomes LastTest.log when ctest ends), LastTest.log when run by hand afterwards.
# Usage: report_skips.sh <build dir>. Always exits 0: a report must not turn a run into a failure.
log="${1:-.}/Testing/Temporary/LastTest.log"
[ -f "$log.tmp" ] && log="$log.tmp"
[ -f "$log" ] || exit 0
awk '
  /^[0-9]+\/[0-9]+ Test: / { sub(/^[0-9]+\/[0-9]+ Test: /, ""); name = $0; reasons = ""; next }
  /BOOSTER_TEST_SKIPPED: / || /is not supported by this CPU/ {
    # The marker may follow a colour code or another rank'"'"'s output on the same line.
    line = $0; if (match(line, /BOOSTER_TEST_SKIPPED: /)) line = substr(line, RSTART + RLENGTH)
    if (index(reasons, "\t" line "\t") == 0) reasons = reasons "\t" line "\t"
    next
  }
  /^Skip regular expression found in output/ {
    n++
    gsub(/\t\t/, "; ", reasons); gsub(/\t/, "", reasons)
    out = out sprintf("  %s: %s\n", name, reasons == "" ? "(no reason printed)" : reasons)
  }
  END { if (n) printf "\n%d skipped, and why:\n%s", n, out }
' "$log"
exit 0
