#!/usr/bin/env bash
# Runs BUILD_DIR's ctest suite (extra arguments go to ctest, e.g. -L unit or -LE sweep), keeps
# its output in BUILD_DIR/ctest.log, and ends with the ten slowest tests, so that each run
# shows where the time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
log=$build_dir/ctest.log
set +e
ctest --test-dir "$build_dir" --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 600 "$@" 2>&1 |
  tee "$log"
rc=${PIPESTATUS[0]}
set -e
echo "ten slowest tests ($build_dir):"
# ctest's result lines: "  12/684 Test  #34: name ....   Passed   12.34 sec".
grep -E '^ *[0-9]+/[0-9]+ +Test +#[0-9]+: ' "$log" |
  sed -E 's/^ *[0-9]+\/[0-9]+ +Test +#[0-9]+: ([^ ]+) .* ([0-9.]+) sec$/\2 \1/' |
  sort -rn | head -n 10 | awk '{printf "  %8.1f s  %s\n", $1, $2}' || true
# A CI log is often read from its end: repeat what each failed test printed (its last lines)
# there, after the summary.
if [ "$rc" -ne 0 ]; then
  echo "output of the failed tests ($build_dir), last 25 lines each:"
  awk '/Test +#[0-9]+: .*\*\*\*(Failed|Timeout|Exception)/ { if (n) flush(); name = $0; n = 0; next }
       /^ *Start +[0-9]+: |^ *[0-9]+\/[0-9]+ +Test +#[0-9]+: |^[0-9]+% tests passed/ { if (name != "") flush(); next }
       name != "" { buf[n++ % 25] = $0 }
       function flush(  i, from) { print name; from = n > 25 ? n - 25 : 0
         for (i = from; i < n; i++) print "    " buf[i % 25]; name = ""; n = 0 }
       END { if (name != "") flush() }' "$log" || true
fi
exit "$rc"
