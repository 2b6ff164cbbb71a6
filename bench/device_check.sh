#!/usr/bin/env bash
# One-shot check of the CUDA backend on a GPU machine (meant to finish in under 5 minutes):
#   1. configure + build (Release, all cores),
#   2. the GPU tests (ctest -R Cuda: loopback ranks on one GPU, NCCL ranks on several GPUs,
#      batches against the fp64 reference), the GPU executor on the emulated device, and the
#      NVRTC compiles of every shipped kernel,
#   3. hsap_attn_perf on the GPU (4 loopback ranks) for bf16, head dim 128, one causal
#      document and packed causal documents, then a plan of 2 groups of 2, checked against
#      the fp64 reference, with the share of transfer time hidden behind compute (fwdHid%,
#      bwdHid%). The two single-plan runs also time cuDNN's fused flash-attention forward on the
#      whole row with the same inputs (bench/cudnn_attention.h: '# cuDNN' lines after each row,
#      fwd ms, TFLOP/s, ours/cuDNN, its #wrong against the reference), or say why it was
#      unavailable; the summary ends with those figures. Forward of batches without a plan
#      runs fused (peer windows, lib/cuda/runtime/peer_window.h); the packed rows run once more with
#      --fused 0 (forward through loopback transfer stages) for comparison.
# Results go to $OUT (when set) or ./device_check_out: build log, test logs, summary.txt.
# Usage: bench/device_check.sh [build-dir]
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
PERF="$BUILD/hsap_attn_perf"
[ -x "$PERF" ] || PERF="$BUILD/bench/hsap_attn_perf"
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
# cuDNN's figures, from the hsap_attn_perf runs above (forward only).
say "## cuDNN fused attention forward (whole row, one call) next to ours"
for layout in causal packed; do
  f="$RESULTS/attn_perf_$layout.txt"
  if grep -q '^# cuDNN ' "$f" 2>/dev/null; then
    grep -E '^# (cuDNN |Avg cuDNN)' "$f" | sed "s/^/  $layout: /" | tee -a "$SUMMARY"
  else
    reason=$(grep -m1 -h '^# cuDNN: unavailable' "$f" 2>/dev/null)
    say "  $layout: ${reason:-no cuDNN figures (hsap_attn_perf did not reach them; see attn_perf_$layout.txt)}"
  fi
done

say "done in $(elapsed), status $status; results in $RESULTS"
exit $status
