#!/usr/bin/env bash
# bench/device_check.sh without a GPU: it parses (bash -n), and its dry run lists, in order,
# the build, the GPU tests, the one-rank speed runs beside cuDNN (bf16, D = 128, 32768 tokens,
# one causal document and a packed row, with the cuDNN and the JIT engine; 131072 tokens with
# the cuDNN engine; the causal JIT row again with HSAP_JIT_SM90A=0), the 4- and 8-rank
# loopback ring and plan runs of 16K-128K tokens with the reference check on, the 4-rank cuDNN
# engine run, the cuDNN engine's checked runs on every mask kind (1 and 4 ranks), and the
# compute-sanitizer run.
# Usage: device_check_test.sh DEVICE_CHECK_SH
set -uo pipefail
script=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

bash -n "$script" || fail "bash -n $script"
out=$(DEVICE_CHECK_DRY_RUN=1 OUT="$tmp/out" bash "$script" "$tmp/build") || fail "dry run exits $?"
[ ! -e "$tmp/build" ] || fail "the dry run built something"
[ ! -e "$tmp/out" ] || fail "the dry run wrote results"

# The order of the steps.
line_of() { grep -n -m1 -- "$1" <<< "$out" | cut -d: -f1; }
build=$(line_of '^build: ')
tests=$(line_of 'lib_api_cuda_test --gtest_filter=CudaGpu')
speed=$(line_of '> speed_causal_cudnn.txt')
loop=$(line_of '> loopback_ring4_causal.txt')
memcheck=$(line_of 'compute-sanitizer --tool memcheck')
for v in build tests speed loop memcheck; do [ -n "${!v}" ] || fail "no $v step: $out"; done
[ "$build" -lt "$tests" ] && [ "$tests" -lt "$speed" ] && [ "$speed" -lt "$loop" ] &&
  [ "$loop" -lt "$memcheck" ] || fail "steps out of order: $out"

# The build has what the steps run.
for target in hsap_attn_perf lib_api_cuda_test bench_cudnn_attention_test \
              lib_cuda_exec_gpu_reference_test; do
  grep -q "^build: .*\b$target\b" <<< "$out" || fail "the build lacks $target"
done

# Speed: one rank, bf16, D = 128, beside cuDNN (not switched off), 32768 tokens of both layouts
# with both engines, and 131072 tokens of one causal document with the cuDNN engine.
for run_name in causal_cudnn packed_cudnn causal_jit packed_jit long_cudnn; do
  l=$(grep "> speed_$run_name.txt" <<< "$out") || fail "no $run_name speed run"
  for want in "--ranks 1" "--dtype bf16" "--head-dim 128" "--heads 16" "--engine ${run_name#*_}"; do
    grep -q -- "$want" <<< "$l" || fail "$run_name speed run lacks $want: $l"
  done
  case $run_name in
    long_*) tokens=131072 ;;
    *) tokens=32768 ;;
  esac
  grep -q -- "-b $tokens -e $tokens" <<< "$l" || fail "$run_name speed run is not $tokens tokens: $l"
  grep -q -- "--cudnn 0" <<< "$l" && fail "$run_name speed run skips cuDNN: $l"
  case $run_name in
    packed_*) grep -q -- "--docs-dist longtail" <<< "$l" || fail "$run_name is not packed: $l" ;;
    *) grep -q -- "--docs-dist single" <<< "$l" || fail "$run_name is not one document: $l" ;;
  esac
done

# The causal JIT row again on the sm_90 kernels (HSAP_JIT_SM90A=0), beside the sm_90a forward.
l=$(grep "> speed_causal_jit_sm90.txt" <<< "$out") || fail "no sm_90 comparison run"
for want in "HSAP_JIT_SM90A=0" "--ranks 1" "--head-dim 128" "-b 32768 -e 32768" "--engine jit" \
            "--docs-dist single"; do
  grep -q -- "$want" <<< "$l" || fail "the sm_90 comparison run lacks $want: $l"
done

# Calibration: one rank, one causal document of 16K-128K tokens, the file hsap_plan reads.
l=$(grep "> calibration.txt" <<< "$out") || fail "no calibration run"
for want in "--ranks 1" "--head-dim 128" "-b 16384" "-e 131072" "--docs-dist single" \
            "--engine jit" "--calibration-out"; do
  grep -q -- "$want" <<< "$l" || fail "the calibration run lacks $want: $l"
done

# The later runs choose their engines by that file (the dry run writes none to pass on).
grep -q 'export HSAP_CALIBRATION="$RESULTS/calibration.json"' "$script" ||
  fail "the calibration file is not passed on as HSAP_CALIBRATION"

# Loopback: 4 and 8 ranks, ring and plan, 16K to 128K tokens, checked against the reference.
loops=$(grep "> loopback_" <<< "$out")
for want in "--ranks 4" "--ranks 8" "--groups 2,2" "--groups 4,4" "-b 16384" "-e 131072" \
            "--docs-dist single" "--docs-dist longtail"; do
  grep -q -- "$want" <<< "$loops" || fail "no loopback run with $want: $loops"
done
while read -r l; do
  grep -q -- "--backend cuda-loopback" <<< "$l" || fail "not on the GPU: $l"
  grep -q -- "--reference auto" <<< "$l" || fail "a loopback run without the reference: $l"
  grep -qE -- "(^| )-c 0( |$)" <<< "$l" && fail "a loopback run that does not check: $l"
done <<< "$loops"

# The cuDNN engine on 4 loopback ranks: 64K packed, beside cuDNN's whole-row call.
l=$(grep "> loopback_ring4_packed_cudnn.txt" <<< "$out") || fail "no 4-rank cuDNN engine run"
for want in "--engine cudnn" "--ranks 4" "-b 65536 -e 65536" "--docs-dist longtail" "--cudnn 1"; do
  grep -q -- "$want" <<< "$l" || fail "the 4-rank cuDNN engine run lacks $want: $l"
done

# The cuDNN engine checked on every mask kind (--mask mixed), on 1 and on 4 loopback ranks.
for r in 1 4; do
  l=$(grep "> loopback_ring${r}_mixed_cudnn.txt" <<< "$out") || fail "no $r-rank mixed cuDNN run"
  for want in "--engine cudnn" "--ranks $r" "--mask mixed" "--reference auto"; do
    grep -q -- "$want" <<< "$l" || fail "the $r-rank mixed cuDNN run lacks $want: $l"
  done
done

# Every step runs under a time limit: `run LOG LIMIT CMD...`.
calls=$(grep -E '^\s*run ' "$script") || fail "no run calls"
while read -r l; do
  grep -qE '^\s*run +"?[A-Za-z0-9_.$]+"? +[0-9]+ ' <<< "$l" || fail "a step without a time limit: $l"
done <<< "$calls"
echo "ok"
