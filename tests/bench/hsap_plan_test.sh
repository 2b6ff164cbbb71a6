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

# Pricing: the engine and the calibration that priced the plan are named; a calibration file
# in the format hsap_attn_perf --calibration-out writes prices the plan with its figures (one
# H200, 32K causal, 16 heads of 128: forward 4 x 128 x 32768 x 32769 / 2 x 16 FLOPs at 300
# TFLOP/s is 14.661 ms, backward 2.5x that at 200 TFLOP/s 54.977 ms).
echo '{"nodes": [{"kind": "H200", "devices": 1}]}' > "$tmp/h200.json"
echo '{"layers": 1, "heads_q": 16, "heads_kv": 16, "head_dim": 128, "hidden": 2048}' > "$tmp/m.json"
one=(--cluster "$tmp/h200.json" --model "$tmp/m.json" --seq 32768)
out=$("$plan" "${one[@]}") || fail "one H200 exits $?"
grep -q '^# priced: engine cudnn, calibration built-in H200 (measured 2026-12)$' <<< "$out" ||
  fail "no priced line: $out"
grep -qE '^  hsap +hsap groups H200:1 +7\.49[0-9] +21\.2[0-9]{2} ' <<< "$out" ||
  fail "one H200 with cuDNN is not the measured 7.50 / 21.28 ms: $out"
cat > "$tmp/cal.json" <<'EOF_CAL'
{"format": "hsap-calibration", "version": 1, "name": "test file",
 "rates": [{"device_kind": "H200", "engine": "jit", "direction": "forward",
            "block_tokens": 32768, "head_dim": 128, "tflops": 300},
           {"device_kind": "H200", "engine": "jit", "direction": "backward",
            "block_tokens": 32768, "head_dim": 128, "tflops": 200}]}
EOF_CAL
out=$("$plan" "${one[@]}" --engine jit --calibration "$tmp/cal.json") || fail "--calibration exits $?"
grep -q '^# priced: engine jit, calibration test file$' <<< "$out" || fail "file not named: $out"
grep -qE '^  hsap +hsap groups H200:1 +14\.66[0-9] +54\.97[0-9] ' <<< "$out" ||
  fail "the file's rates do not price the plan: $out"
"$plan" "${one[@]}" --engine tpu > /dev/null 2> "$tmp/err"; rc=$?
[ "$rc" = 2 ] && grep -q 'unknown attention engine "tpu"' "$tmp/err" || fail "--engine tpu: $rc"
"$plan" "${one[@]}" --calibration "$tmp/none.json" > /dev/null 2> "$tmp/err"; rc=$?
[ "$rc" = 1 ] && grep -q "cannot open calibration file $tmp/none.json" "$tmp/err" ||
  fail "a missing calibration file: $rc $(cat "$tmp/err")"

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
