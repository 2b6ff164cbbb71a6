#!/usr/bin/env bash
# hsap_plan's command line and outputs: --help, every output write checked, the SVG of a
# cluster larger than it draws says so, a cluster beyond the planner's range is refused fast.
# Usage: hsap_plan_test.sh HSAP_PLAN CLUSTERS_DIR
set -uo pipefail
plan=$1 clusters=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# --help: the usage on stdout, exit 0.
out=$("$plan" --help) || fail "--help exits $?"
grep -q '^usage: hsap_plan' <<< "$out" || fail "--help prints no usage: $out"
"$plan" --bogus > /dev/null 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] || fail "an unknown option exits $rc, not 2"
grep -q 'unknown option --bogus' "$tmp/err" || fail "unknown option not named: $(cat "$tmp/err")"

small=$clusters/testbed_8h100_8a100.json
# Outputs that work.
"$plan" --cluster "$small" --json "$tmp/plan.json" --svg "$tmp/plan.svg" > /dev/null ||
  fail "plan with --json and --svg exits $?"
grep -q '"num_ranks"' "$tmp/plan.json" || fail "plan.json has no num_ranks"
grep -q '</svg>' "$tmp/plan.svg" || fail "plan.svg is not a whole picture"
if grep -q 'are drawn' "$tmp/plan.svg"; then fail "16 devices: the picture claims devices are left out"; fi

# --json into a folder that does not exist, --svg given a folder: exit 1 with the reason.
"$plan" --cluster "$small" --json "$tmp/no/such/dir/plan.json" > /dev/null 2> "$tmp/err"; rc=$?
[ "$rc" = 1 ] || fail "--json into a missing folder exits $rc"
grep -q 'cannot write .*no/such/dir/plan.json' "$tmp/err" || fail "--json: $(cat "$tmp/err")"
"$plan" --cluster "$small" --svg "$tmp" > /dev/null 2> "$tmp/err"; rc=$?
[ "$rc" = 1 ] || fail "--svg given a folder exits $rc"
grep -q "cannot write $tmp" "$tmp/err" || fail "--svg: $(cat "$tmp/err")"

# --run: the plan and the baselines as the runtime runs them, each with and without node
# stores, deterministic (but for the last column, the time it took).
out=$("$plan" --cluster "$small" --run --docs 4096 --seed 7) || fail "--run exits $?"
grep -q '^# what runs: documents of mean 4096 tokens, seed 7' <<< "$out" || fail "--run: no header: $out"
rows=$(sed -n '/^# what runs/,$p' <<< "$out" | grep -E '^  (hsap|Ring|Ulysses|USP|TE a2a\+p2p) +(yes|no) +[0-9.]+ +[0-9.]+ ')
[ "$(grep -c '^  hsap ' <<< "$rows")" = 2 ] && [ "$(wc -l <<< "$rows")" -ge 4 ] &&
  [ "$(grep -c ' yes ' <<< "$rows")" = "$(grep -c ' no ' <<< "$rows")" ] ||
  fail "--run: not two rows (stores yes / no) for the plan and each baseline: $out"
again=$("$plan" --cluster "$small" --run --docs 4096 --seed 7) || fail "--run exits $?"
[ "$(sed -n '/^# what runs/,$p' <<< "$out" | awk '{$NF=""; print}')" = "$(sed -n '/^# what runs/,$p' <<< "$again" | awk '{$NF=""; print}')" ] ||
  fail "--run is not deterministic"
"$plan" --cluster "$small" --run --docs -1 > /dev/null 2>&1; rc=$?
[ "$rc" = 2 ] || fail "--docs -1 exits $rc, not 2"

# More devices than the picture draws: the picture says so.
"$plan" --cluster "$clusters/scale1024_h100_a100.json" --svg "$tmp/big.svg" > /dev/null \
  2> "$tmp/err" || fail "1024 devices with --svg exits $?: $(cat "$tmp/err")"
grep -q 'only devices 0-127 of 1024 are drawn' "$tmp/big.svg" || fail "big.svg does not say what it leaves out"

# A cluster beyond the planner's range: refused at once with the supported range.
echo '{"nodes": [{"kind": "H100", "nic_gbps": 50, "devices": 16, "count": 65536}]}' > "$tmp/huge.json"
start=$(date +%s)
timeout 60 "$plan" --cluster "$tmp/huge.json" > /dev/null 2> "$tmp/err"; rc=$?
[ "$rc" = 1 ] || fail "a 2^20-device cluster exits $rc: $(cat "$tmp/err")"
grep -q 'the cluster has 1048576 devices; the planner plans clusters of 1 to 4096 devices' \
  "$tmp/err" || fail "huge cluster: $(cat "$tmp/err")"
[ $(( $(date +%s) - start )) -le 20 ] || fail "refusing a 2^20-device cluster took over 20 s"

echo "hsap_plan test passed"
