#!/usr/bin/env bash
# bench/device_check.sh without a GPU: it parses (bash -n), and its dry run lists the
# tensor-core section's runs: forward+backward at bf16, D = 128, 32768 tokens for one causal
# document and a packed row (cuDNN's forward on the same runs), a reference-checked run of
# each, and the resource report / roofline of the launched kernels.
# Usage: device_check_test.sh DEVICE_CHECK_SH
set -uo pipefail
script=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

bash -n "$script" || fail "bash -n $script"
out=$(DEVICE_CHECK_DRY_RUN=1 OUT="$tmp/out" bash "$script" "$tmp/build") || fail "dry run exits $?"
[ ! -e "$tmp/build" ] || fail "the dry run built something"
for layout in causal packed; do
  line=$(grep "> tc_$layout.txt" <<< "$out") || fail "no 32K $layout run: $out"
  for want in "--ranks 1" "--dtype bf16" "--head-dim 128" "-b 32768" "-e 32768"; do
    grep -q -- "$want" <<< "$line" || fail "$layout run lacks $want: $line"
  done
  grep -q -- "--cudnn 0" <<< "$line" && fail "$layout 32K run skips cuDNN: $line"
  check=$(grep "> tc_${layout}_check.txt" <<< "$out") || fail "no checked $layout run"
  grep -q -- "-c 1" <<< "$check" || fail "the $layout check run does not check: $check"
done
grep -q -- "--docs-dist single" <<< "$(grep '> tc_causal.txt' <<< "$out")" ||
  fail "the causal run is not one document"
grep -q "hsap_roofline sm_90 > roofline.txt" <<< "$out" || fail "no resource report: $out"
grep -q "cuDNN backward" <<< "$out" || fail "the missing cuDNN backward is not said"
echo "ok"
