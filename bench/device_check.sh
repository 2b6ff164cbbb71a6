#!/usr/bin/env bash
# One-shot check of the CUDA backend on a GPU machine (meant to finish in under 8 minutes):
#   1. configure + build (Release, all cores),
#   2. the GPU tests (ctest -R Cuda: loopback ranks on one GPU, NCCL ranks on several GPUs,
#      batches against the fp64 reference), the GPU executor on the emulated device, and the
#      NVRTC compiles of every shipped kernel,
#   3. hsap_attn_perf on the GPU (4 loopback ranks) for bf16, head dim 128, one causal
#      document and packed causal documents, then a plan of 2 groups of 2, checked against
#      the fp64 reference, with the share of transfer time hidden behind compute (fwdHid%,
#      bwdHid%). The two single-plan runs also time cuDNN's fused flash-attention forward and
#      backward on the whole row with the same inputs (bench/cudnn_attention.h: '# cuDNN' lines
#      after each row, fwd / bwd ms, TFLOP/s, ours/cuDNN, its #wrong against the reference),
#      or say why it was unavailable; the summary ends with those figures. Forward of batches without a plan
#      runs fused (peer windows, lib/cuda/runtime/peer_window.h); the packed rows run once more with
#      --fused 0 (forward through loopback transfer stages) for comparison.
#   4. the tensor-core kernels on one GPU (bf16, D = 128, 32K tokens: one causal document and
#      a packed row): hsap_attn_perf with one loopback rank prints our forward and backward
#      TFLOP/s over visible pairs, cuDNN's forward and backward on the same input with the
#      ratios, and (on 8192 tokens) the errors of both against the fp64 reference; then the
#      ptxas resource report and roofline of the kernels those runs launch (hsap_roofline).
# Results go to $OUT (when set) or ./device_check_out: build log, test logs, summary.txt.
# Usage: bench/device_check.sh [build-dir]
#   DEVICE_CHECK_DRY_RUN=1: print the steps' commands instead of running them (no build, no
#   GPU; tests/bench/device_check_test.sh checks them).
#   DEVICE_CHECK_TC_ONLY=1: only step 4, with the binaries already in build-dir (a rerun of
#   the tensor-core comparison without the build and the other steps).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build-device-check}"
RESULTS="${OUT:-$ROOT/device_check_out}"
mkdir -p "$RESULTS"
SUMMARY="$RESULTS/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START ))s; }

# run LOG CMD...: runs CMD with its output in $RESULTS/LOG (or only prints it, dry run).
DRY=${DEVICE_CHECK_DRY_RUN:-0}
run() {
  local log=$1
  shift
  if [ "$DRY" = 1 ]; then
    echo "run: $* > $log"
    return 0
  fi
  "$@" > "$RESULTS/$log" 2>&1
}

# The tensor-core section (step 4): our forward/backward and cuDNN's, one GPU.
tensor_core_section() {
  local perf=$1 roofline=$2
  local layout docs
  for layout in causal packed; do
    case $layout in
      causal) docs=(--docs-dist single) ;;
      packed) docs=(--docs-dist longtail --tokens-per-doc 2048) ;;
    esac
    say "## tensor cores, one GPU: bf16, d=128, 32768 tokens, $layout (fwd+bwd; cuDNN fwd+bwd)"
    run "tc_$layout.txt" timeout 120 "$perf" --backend cuda-loopback --ranks 1 --dtype bf16 \
      --head-dim 128 --heads 16 --kv-heads 16 -b 32768 -e 32768 -n 10 -w 3 -c 0 \
      "${docs[@]}" || status=1
    [ "$DRY" = 1 ] || tee -a "$SUMMARY" < "$RESULTS/tc_$layout.txt"
    # The errors against the fp64 reference on the same kernels and on cuDNN's: 8192 tokens,
    # 4 heads (the reference of the 32K row would take the CPU longer than the whole check).
    say "## tensor cores and cuDNN, errors against the fp64 reference: 8192 tokens, 4 heads, $layout"
    run "tc_${layout}_check.txt" timeout 120 "$perf" --backend cuda-loopback --ranks 1 \
      --dtype bf16 --head-dim 128 --heads 4 --kv-heads 4 -b 8192 -e 8192 -n 2 -w 1 -c 1 \
      --ref-max-gflop 100 "${docs[@]}" || status=1
    [ "$DRY" = 1 ] || tee -a "$SUMMARY" < "$RESULTS/tc_${layout}_check.txt"
  done
  # Ours against cuDNN, forward and backward, from the 32K runs ('# cuDNN' lines; the first
  # says why when cuDNN was unavailable).
  say "## tensor cores against cuDNN, 32768 tokens: fwd and bwd TFLOP/s, ours/cuDNN"
  for layout in causal packed; do
    [ "$DRY" = 1 ] && continue
    if grep -qE '^# cuDNN +[0-9]+ (fwd|bwd)' "$RESULTS/tc_$layout.txt" 2>/dev/null; then
      grep -E '^# (cuDNN +[0-9]+ (fwd|bwd)|cuDNN backward: unavailable)' "$RESULTS/tc_$layout.txt" \
        | sed "s/^/  $layout: /" | tee -a "$SUMMARY"
    else
      reason=$(grep -m1 -h '^# cuDNN: unavailable' "$RESULTS/tc_$layout.txt" 2>/dev/null)
      say "  $layout: ${reason:-no cuDNN figures (see tc_$layout.txt)}"
    fi
  done
  say "## resource report and roofline of the launched kernels (ptxas -v via NVRTC)"
  run roofline.txt "$roofline" sm_90 || status=1
  if [ "$DRY" != 1 ]; then
    grep -E '^(#|variant)|sm90_bf16_d128_g1_(band|full)_tc ' "$RESULTS/roofline.txt" \
      | tee -a "$SUMMARY"
  fi
}

# bench binaries: at the top of the build tree or under bench/.
bench_bin() {
  if [ -x "$BUILD/$1" ] || [ "$DRY" = 1 ]; then echo "$BUILD/$1"; else echo "$BUILD/bench/$1"; fi
}

if [ "$DRY" = 1 ]; then
  status=0
  tensor_core_section "$(bench_bin hsap_attn_perf)" "$(bench_bin hsap_roofline)"
  exit 0
fi
if [ "${DEVICE_CHECK_TC_ONLY:-0}" = 1 ]; then
  status=0
  say "# hsap device check, tensor-core section only, $(date -u +%FT%TZ), $(uname -n)"
  tensor_core_section "$(bench_bin hsap_attn_perf)" "$(bench_bin hsap_roofline)"
  say "done in $(elapsed), status $status; results in $RESULTS"
  exit $status
fi

say "# hsap device check, $(date -u +%FT%TZ), $(uname -n)"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader \
    | sed 's/^/# gpu: /' | tee -a "$SUMMARY"
else
  say "# gpu: nvidia-smi not found (the GPU tests will skip and say why)"
fi

# 1. Build.
if ! cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release > "$RESULTS/configure.log" 2>&1 \
   || ! cmake --build "$BUILD" -j"$(nproc)" > "$RESULTS/build.log" 2>&1; then
  say "BUILD FAILED after $(elapsed); see build.log / configure.log"
  tail -30 "$RESULTS/build.log" 2>/dev/null
  exit 1
fi
say "build: ok ($(elapsed))"

# 2. GPU tests (skipped tests print their reason: "no CUDA device: ...").
status=0
ctest --test-dir "$BUILD" -R Cuda -j"$(nproc)" --output-on-failure --timeout 180 > "$RESULTS/ctest_cuda.log" 2>&1 \
  || status=1
say "ctest -R Cuda: $(grep -E 'tests passed|tests failed' "$RESULTS/ctest_cuda.log" | tail -1) ($(elapsed))"
grep -E '\(Skipped\)|\(Failed\)|Skipped$' "$RESULTS/ctest_cuda.log" | sed 's/^/  /' | tee -a "$SUMMARY"
# The reason of a skip, once.
grep -m1 -h 'no CUDA device' "$BUILD"/Testing/Temporary/LastTest.log 2>/dev/null \
  | sed 's/^/  skip reason: /' | tee -a "$SUMMARY"
ctest --test-dir "$BUILD" -R 'Nvrtc|CudaCodegen|CudaEmulation|ShippedCuda|GpuExecutor|GpuBatch|GpuHier' \
  -j"$(nproc)" --timeout 300 \
  > "$RESULTS/ctest_nvrtc.log" 2>&1 || status=1
say "NVRTC / kernel tests: $(grep -E 'tests passed|tests failed' "$RESULTS/ctest_nvrtc.log" | tail -1) ($(elapsed))"

# 3. Attention on the GPU.
PERF=$(bench_bin hsap_attn_perf)
for layout in causal packed; do
  case $layout in
    causal) docs=(--docs-dist single) ;;
    packed) docs=(--docs-dist longtail --tokens-per-doc 2048) ;;
  esac
  say "## hsap_attn_perf --backend cuda-loopback, 4 ranks, bf16, d=128, $layout"
  timeout 150 "$PERF" --backend cuda-loopback --ranks 4 --dtype bf16 --head-dim 128 --heads 16 \
    --kv-heads 4 -b 16384 -e 65536 -f 2 -n 5 -w 2 --ref-max-gflop 4 "${docs[@]}" \
    > "$RESULTS/attn_perf_$layout.txt" 2>&1 || status=1
  tee -a "$SUMMARY" < "$RESULTS/attn_perf_$layout.txt"
done
# The same packed rows with forward through loopback transfer stages instead of the fused
# kernel reading the peer windows: the two forward times side by side.
say "## hsap_attn_perf --backend cuda-loopback, packed, --fused 0 (forward through transfer stages)"
timeout 120 "$PERF" --backend cuda-loopback --ranks 4 --dtype bf16 --head-dim 128 --heads 16 \
  --kv-heads 4 -b 16384 -e 65536 -f 2 -n 5 -w 2 -c 0 --cudnn 0 --fused 0 --docs-dist longtail \
  --tokens-per-doc 2048 > "$RESULTS/attn_perf_packed_staged.txt" 2>&1 || status=1
tee -a "$SUMMARY" < "$RESULTS/attn_perf_packed_staged.txt"
say "## hsap_attn_perf --backend cuda-loopback, plan: 2 groups of 2 (all-to-all inside, sub-rings across)"
timeout 120 "$PERF" --backend cuda-loopback --groups 2,2 --dtype bf16 --head-dim 128 --heads 16 \
  --kv-heads 4 -b 16384 -e 32768 -f 2 -n 5 -w 2 --ref-max-gflop 4 --docs-dist longtail \
  --tokens-per-doc 4096 > "$RESULTS/attn_perf_plan.txt" 2>&1 || status=1
tee -a "$SUMMARY" < "$RESULTS/attn_perf_plan.txt"
# cuDNN's figures, from the hsap_attn_perf runs above (forward and backward).
say "## cuDNN fused attention forward and backward (whole row, one call) next to ours"
for layout in causal packed; do
  f="$RESULTS/attn_perf_$layout.txt"
  if grep -q '^# cuDNN ' "$f" 2>/dev/null; then
    grep -E '^# (cuDNN |Avg cuDNN)' "$f" | sed "s/^/  $layout: /" | tee -a "$SUMMARY"
  else
    reason=$(grep -m1 -h '^# cuDNN: unavailable' "$f" 2>/dev/null)
    say "  $layout: ${reason:-no cuDNN figures (hsap_attn_perf did not reach them; see attn_perf_$layout.txt)}"
  fi
done

# 4. Tensor-core kernels against cuDNN on one GPU, and their resource report.
ROOFLINE=$(bench_bin hsap_roofline)
tensor_core_section "$PERF" "$ROOFLINE"

say "done in $(elapsed), status $status; results in $RESULTS"
exit $status
