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
exit "$rc"
