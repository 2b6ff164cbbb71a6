#!/usr/bin/env bash
# Counts the reliability tests (bad input, limits, faults, ...) by category, from the test
# names `ctest -N` lists (GoogleTest cases are registered one ctest test each), and prints
# the command that runs each category. A test may fall in more than one category; the
# total counts each once.
#
#   scripts/reliability_counts.sh [--run] [build_dir (default build)]
#
# --run: also runs every test of the categories (ctest -R with their union).
set -euo pipefail
cd "$(dirname "$0")/.."
run=0
if [[ "${1:-}" == "--run" ]]; then
  run=1
  shift
fi
build_dir=${1:-build}
if [[ ! -f "$build_dir/CTestTestfile.cmake" ]]; then
  echo "no tests in $build_dir: build first (bash scripts/build.sh)" >&2
  exit 1
fi

# Category name | extended regex over test names.
categories=(
  "null and invalid arguments|Null|RejectsBad|BadArguments|BadInitArguments|RejectsNulls|InvalidArgument|RejectsWhat|RejectsEmptyDims|HeadDimOutsideTheRule|InvalidSpec|ArgumentsThatDoNotMatch|ArgumentChecks|InvalidInputs|BadWeightsAndShapes|RejectsBadOptions|RejectsBadOperations|ChecksArgumentsFirst|NegativeRequestRejected|MalformedOrNonPositive"
  "limits and overflow|Limit|Overflow|BeyondAnyRow|BeyondTheGrid|BeyondTheSupportedRange|SmallPoolIsRefused|NeedsRoomFor"
  "rank disagreement|Mismatch|Disagree|OnEveryRank|OnBothRanks|OnBothSides|FailEveryRank"
  "timeouts, abort and faults|Timeout|TimesOut|Abort|Fault|NeverArrives|NeverCalls|Withdrawn|CannotPrepare"
  "JIT cache corruption and compiler failures|CompileCacheTest\.(Truncated|Corrupt|Foreign|Fifo|Symlink|Directory|FailedCompile)|Garbage|MalformedImages|SyntaxError|HangingCompiler|UnsupportedHeadDimForced|ProcessesRacing"
  "NaN and inf|NaN|Infinity"
  "config size and version|ApiConfigTest|ApiBatchConfigTest|ApiLocalErrorsTest\.Config|NullConfigUsesDefaults"
  "planner and plan inputs|PlannerTest\.(Infeasible|ClusterBeyond)|ClusterTest\.Malformed|CostModelTest\.Mismatched|PlanTest\.(HeadOwned|RankInTwo|BadWeights|JsonErrors)|PlanCApiTest\.InvalidInputs|InvalidPlans|BadPlans|PlanJson|bench_hsap_plan"
  "messages name the problem|ApiMessagesTest|ErrorsGiveByteLineAndColumn|NamesThe|NameIt"
  "fuzz|Fuzz|Mutation"
)

names=$(ctest --test-dir "$build_dir" -N 2>/dev/null | sed -n 's/^ *Test *#[0-9]*: \([^ ]*\).*/\1/p')
total=$(printf '%s\n' "$names" | grep -c . || true)
union=""
printf '%-44s %5s  %s\n' "category" "tests" "command"
for entry in "${categories[@]}"; do
  name=${entry%%|*}
  regex=${entry#*|}
  count=$(printf '%s\n' "$names" | grep -E -c -- "$regex" || true)
  printf '%-44s %5d  ctest --test-dir %s -R '"'"'%s'"'"'\n' "$name" "$count" "$build_dir" "$regex"
  union=${union:+$union|}$regex
done
distinct=$(printf '%s\n' "$names" | grep -E -c -- "$union" || true)
printf '%-44s %5d  of %d tests (scripts/reliability_counts.sh --run runs them)\n' \
  "all categories (each test once)" "$distinct" "$total"
if [[ $run == 1 ]]; then
  ctest --test-dir "$build_dir" -R "$union" --output-on-failure -j "${JOBS:-2}" --timeout 600
fi
