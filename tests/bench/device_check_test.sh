#!/usr/bin/env bash
# bench/device_check.sh without a GPU: it parses (bash -n), and its dry run lists the
# tensor-core section's runs: forward+backward at bf16, D = 128, 32768 tokens for one causal
# document and a packed row (cuDNN's forward and backward on the same runs), a
# reference-checked run of each (cuDNN's too), and the resource report / roofline of the
# launched kernels. Then the section runs for real (DEVICE_CHECK_TC_ONLY=1) on stand-in
# binaries that print what hsap_attn_perf prints, and its summary carries cuDNN's forward and
# backward lines for both layouts, or the reason cuDNN's backward was unavailable.
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
for layout in causal packed; do
  grep -q "32768 tokens, $layout (fwd+bwd; cuDNN fwd+bwd)" <<< "$out" ||
    fail "the $layout section does not compare cuDNN's backward: $out"
  grep -q -- "--cudnn 0" <<< "$(grep "> tc_${layout}_check.txt" <<< "$out")" &&
    fail "the $layout check run leaves cuDNN's errors out"
done
grep -q "not compared" <<< "$out" && fail "a comparison is still said to be missing: $out"
grep -q "tensor cores against cuDNN" <<< "$out" || fail "no ours-vs-cuDNN summary: $out"

# The section on stand-in binaries: what the summary keeps of their output.
bin="$tmp/bin"
mkdir -p "$bin"
cat > "$bin/hsap_attn_perf" <<'EOF'
#!/usr/bin/env bash
# Prints the lines hsap_attn_perf prints around cuDNN (figures made up). $STANDIN_BWD:
# "ok" or a reason for an unavailable backward.
case " $* " in *" -b 8192 "*) T=8192 ;; *) T=32768 ;; esac
echo "#   $T     1      0      9.000     25.000  100.0000  110.0000  -  -  -  0  -"
echo "# cuDNN 9.19.0, workspace 0B"
echo "# cuDNN     $T fwd(ms)      6.000 fwdTF/s  150.0000 ours/cuDNN   0.667 #wrong - max|err| -"
if [ "$STANDIN_BWD" = ok ]; then
  echo "# cuDNN backward: workspace 0B, scratch 64.00MB"
  echo "# cuDNN     $T bwd(ms)     20.000 bwdTF/s  137.5000 ours/cuDNN   0.800 #wrong - max|err| -"
else
  echo "# cuDNN backward: unavailable ($STANDIN_BWD)"
fi
EOF
printf '#!/usr/bin/env bash\necho "variant sm90_bf16_d128_g1_band_tc regs 128"\n' > "$bin/hsap_roofline"
chmod +x "$bin/hsap_attn_perf" "$bin/hsap_roofline"
for bwd in ok "no engine supports the fused attention graph"; do
  rm -rf "$tmp/real"
  STANDIN_BWD=$bwd DEVICE_CHECK_TC_ONLY=1 OUT="$tmp/real" bash "$script" "$bin" > /dev/null ||
    fail "the tensor-core section on stand-ins exits $?"
  summary="$tmp/real/summary.txt"
  [ -f "$summary" ] || fail "no summary"
  [ -e "$bin/CMakeCache.txt" ] && fail "the tensor-core-only run configured a build"
  for layout in causal packed; do
    grep -qE "^  $layout: # cuDNN +32768 fwd\(ms\)" "$summary" ||
      fail "no cuDNN forward line for $layout: $(cat "$summary")"
    if [ "$bwd" = ok ]; then
      grep -qE "^  $layout: # cuDNN +32768 bwd\(ms\) +20.000 bwdTF/s +137.5000 ours/cuDNN +0.800" \
        "$summary" || fail "no cuDNN backward line for $layout: $(cat "$summary")"
    else
      grep -q "^  $layout: # cuDNN backward: unavailable (no engine supports" "$summary" ||
        fail "the reason of the missing backward is not said for $layout: $(cat "$summary")"
    fi
  done
  grep -q "sm90_bf16_d128_g1_band_tc" "$summary" || fail "no resource report in the summary"
done
echo "ok"
