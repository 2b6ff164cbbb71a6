#!/usr/bin/env bash
# One device check on a GPU machine, sized to a lease: under 5 minutes on one H200. In order:
#   1. build (Release, every core) of the library, the benches it runs and the GPU tests;
#   2. the GPU tests: loopback ranks on one GPU against the fp64 reference (lib_api_cuda_test),
#      cuDNN's fused attention (bench_cudnn_attention_test), the fp64 GPU reference against
#      the host's (lib_cuda_exec_gpu_reference_test);
#   3. speed, one rank: bf16, d 128, 16 heads, 32768 tokens (one causal document, a packed
#      row) and 131072 (one causal document); hsap's forward and backward TFLOP/s beside
#      cuDNN's whole-row call on the same inputs in the same run (ours/cuDNN), with
#      --engine cudnn and --engine jit; then the calibration run (16K-128K, jit), whose file
#      the later runs get as $HSAP_CALIBRATION;
#   4. 4 and 8 loopback ranks on the GPU, ring and plan batches of 16K-128K tokens (causal and
#      packed), the first row of each run checked against the fp64 reference on the GPU; a
#      4-rank 64K packed row with --engine cudnn beside cuDNN's whole-row call;
#   5. compute-sanitizer memcheck on the loopback reference test (its sweep's subset).
# Every step has a time limit and says what it found; the summary ends with the tables. The
# whole check has a budget (DEVICE_CHECK_BUDGET_S, default 285 s, so that it ends within 5
# minutes of device time): a step's limit is cut to what is left of it, and once it is spent
# the remaining steps are skipped and said to be (in the order above, so the least important
# go first).
# Results go to $OUT (when set) or ./device_check_out: logs per step and summary.txt.
# Usage: bench/device_check.sh [build-dir]
#   DEVICE_CHECK_DRY_RUN=1: print the steps' commands instead of running them (no build, no
#   GPU; tests/bench/device_check_test.sh checks them).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build-device-check}"
RESULTS="${OUT:-$ROOT/device_check_out}"
DRY=${DEVICE_CHECK_DRY_RUN:-0}
[ "$DRY" = 1 ] || mkdir -p "$RESULTS"
SUMMARY="$RESULTS/summary.txt"
[ "$DRY" = 1 ] || : > "$SUMMARY"
say() { if [ "$DRY" = 1 ]; then echo "$*"; else echo "$*" | tee -a "$SUMMARY"; fi; }
START=$(date +%s)
BUDGET=${DEVICE_CHECK_BUDGET_S:-285}
elapsed() { echo $(( $(date +%s) - START ))s; }
status=0

# run LOG LIMIT CMD...: CMD with its output in $RESULTS/LOG, stopped after LIMIT seconds (or
# only printed, dry run). A failure or a stop marks the check failed and is said.
run() {
  local log=$1 limit=$2
  shift 2
  if [ "$DRY" = 1 ]; then
    echo "run: $* > $log"
    return 0
  fi
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -le 5 ]; then
    say "  SKIPPED: $log (the check's ${BUDGET} s budget is spent)" | tee "$RESULTS/$log" > /dev/null
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local rc=0
  timeout "$limit" "$@" > "$RESULTS/$log" 2>&1 || rc=$?
  if [ $rc -ne 0 ]; then
    status=1
    say "  FAILED: $log exit $rc$([ $rc -eq 124 ] && echo " (stopped after ${limit}s)")"
  fi
  return $rc
}
# keep LOG: the lines of a bench log worth the summary (its table, not its preamble).
keep() {
  [ "$DRY" = 1 ] && return 0
  grep -vE '^# (fwdHid|forward K|cuDNN lines|time:|TFLOP/s:|bytes:|#wrong:|a2a, p2p|reference:)' \
    "$RESULTS/$1" | tee -a "$SUMMARY"
}

say "# hsap device check, $(date -u +%FT%TZ), $(uname -n)"
if [ "$DRY" != 1 ] && command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader \
    | sed 's/^/# gpu: /' | tee -a "$SUMMARY"
fi

# 1. Build.
TARGETS="hsap hsap_attn_perf lib_api_cuda_test bench_cudnn_attention_test lib_cuda_exec_gpu_reference_test"
if [ "$DRY" = 1 ]; then
  echo "build: $TARGETS"
elif ! cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release > "$RESULTS/configure.log" 2>&1 \
   || ! cmake --build "$BUILD" -j"$(nproc)" --target $TARGETS > "$RESULTS/build.log" 2>&1; then
  say "BUILD FAILED after $(elapsed); see build.log / configure.log"
  tail -30 "$RESULTS/build.log" 2>/dev/null
  exit 1
fi
say "build: ok ($(elapsed))"
PERF=$BUILD/hsap_attn_perf
TESTS=$BUILD/tests
# The sm_90a forward and backward (wgmma, TMA) are opt-in until they have run on a GPU: this
# check runs them.
export HSAP_JIT_SM90A=1

# 2. GPU tests (a skipped test prints its reason).
say "## GPU tests"
for t in "lib_api_cuda_test --gtest_filter=CudaGpu.*:CudaLoopback.*" \
         "bench_cudnn_attention_test --gtest_filter=CudnnAttentionCudaTest.*" \
         "lib_cuda_exec_gpu_reference_test --gtest_filter=CudaGpuReference.*"; do
  name=${t%% *}
  # shellcheck disable=SC2086
  run "$name.log" 120 $TESTS/$t
  [ "$DRY" = 1 ] || say "  $name: $(grep -E '^\[  (PASSED|FAILED) ' "$RESULTS/$name.log" | tr '\n' ' ')"
done
say "GPU tests done ($(elapsed))"

# 3. Speed, one rank, beside cuDNN's whole-row call, per attention engine (--engine sets
# $HSAP_ATTENTION_ENGINE; each row prints its '# engines' tally). The 128K causal row with the
# JIT engine is the calibration run's last row (3b).
say "## speed, one GPU, one rank: bf16, d 128, 16 heads (ours beside cuDNN's whole row, per engine)"
# engine_run LOG LIMIT ARGS...: hsap_attn_perf ARGS; a build whose executors have no cuDNN
# piece runner refuses --engine cudnn at batch creation: said, and not a failure of the check.
engine_run() {
  local log=$1 limit=$2 before=$status
  shift 2
  if ! run "$log" "$limit" "$PERF" "$@" && [ "$DRY" != 1 ] &&
     grep -q "no cuDNN piece runner" "$RESULTS/$log"; then
    status=$before
    say "  $log: --engine cudnn not run: this build has no cuDNN piece runner (docs/gpu_backend.md)"
    return 0
  fi
  keep "$log"
}
for engine in cudnn jit; do
  for layout in causal packed long; do
    case $layout in
      causal) rows=(-b 32768 -e 32768 -n 5 -w 2 --docs-dist single) ;;
      packed) rows=(-b 32768 -e 32768 -n 5 -w 2 --docs-dist longtail --tokens-per-doc 2048) ;;
      long) [ "$engine" = jit ] && continue  # 3b's last row
            rows=(-b 131072 -e 131072 -n 2 -w 1 --docs-dist single) ;;
    esac
    engine_run "speed_${layout}_$engine.txt" 90 --backend cuda-loopback --ranks 1 --dtype bf16 \
      --head-dim 128 --heads 16 --kv-heads 16 -c 0 --engine "$engine" "${rows[@]}"
  done
done

# 3a. The causal JIT row once more on the sm_90 JIT kernels (the mma.sync forward): on a
# compute capability 9.0 GPU step 3 ran the sm_90a forward (wgmma, TMA; docs/gpu_backend.md),
# so the two rows compare them; elsewhere both run the same kernels.
say "## speed, the causal JIT row with HSAP_JIT_SM90A=0 (sm_90 kernels; step 3 ran sm_90a's on a 9.0 GPU)"
run "speed_causal_jit_sm90.txt" 90 env HSAP_JIT_SM90A=0 "$PERF" --backend cuda-loopback \
  --ranks 1 --dtype bf16 --head-dim 128 --heads 16 --kv-heads 16 -c 0 --engine jit \
  -b 32768 -e 32768 -n 5 -w 2 --docs-dist single
keep "speed_causal_jit_sm90.txt"

# 3b. Calibration of the cost model (docs/cost_model.md): one causal document of 16K-128K
# tokens on one rank, hsap's JIT kernels and cuDNN's whole-row call, written as a calibration
# file that hsap_plan --calibration reads.
say "## calibration: one GPU, one causal document of 16K-128K tokens, bf16, d 128, 16 heads"
run "calibration.txt" 150 "$PERF" --backend cuda-loopback --ranks 1 --dtype bf16 --head-dim 128 \
  --heads 16 --kv-heads 16 -b 16384 -e 131072 -f 2 -n 3 -w 1 -c 0 --docs-dist single \
  --engine jit --calibration-out "$RESULTS/calibration.json"
keep "calibration.txt"
# The later runs' `auto` engine choice goes by the rates just measured (when any were written).
grep -qs '"engine"' "$RESULTS/calibration.json" && export HSAP_CALIBRATION="$RESULTS/calibration.json"

# 4. Loopback ranks: ring and plan batches, the first row of each run checked on the GPU.
# The GPU reference checks rows up to 5000 GFLOP of forward work (the 16K-32K rows here).
CHECK=(--reference auto --gpu-ref-max-gflop 5000)
COMMON=(--backend cuda-loopback --dtype bf16 --head-dim 128 --heads 16 --kv-heads 4 -n 2 -w 1 --cudnn 0)
say "## loopback ranks on one GPU: bf16, d 128, 16/4 heads"
loopback() {  # loopback NAME ARGS...
  local name=$1
  shift
  say "### $name"
  run "loopback_$name.txt" 90 "$PERF" "${COMMON[@]}" "${CHECK[@]}" "$@"
  keep "loopback_$name.txt"
}
loopback ring4_causal --ranks 4 -b 16384 -e 65536 -f 2 --docs-dist single
loopback ring4_packed --ranks 4 -b 16384 -e 65536 -f 2 --docs-dist longtail --tokens-per-doc 2048
loopback ring8_causal --ranks 8 -b 32768 -e 131072 -f 2 --docs-dist single
loopback plan2x2_packed --groups 2,2 -b 16384 -e 65536 -f 2 --docs-dist longtail --tokens-per-doc 4096
loopback plan2x4_causal --groups 4,4 -b 32768 -e 131072 -f 2 --docs-dist single
# The cuDNN engine on 4 loopback ranks, 64K packed, beside one cuDNN call over the row (goal:
# the whole call within 1.3x of it).
say "### ring4_packed_cudnn"
engine_run loopback_ring4_packed_cudnn.txt 90 "${COMMON[@]}" "${CHECK[@]}" --cudnn 1 \
  --engine cudnn --ranks 4 -b 65536 -e 65536 --docs-dist longtail --tokens-per-doc 2048
# The cuDNN engine checked against the fp64 reference on rows of every mask kind (--mask
# mixed: causal, full, prefix and sliding-window documents in turn, so pieces of every cuDNN
# mask), on one rank and on 4 loopback ranks.
for r in 1 4; do
  say "### ring${r}_mixed_cudnn"
  engine_run "loopback_ring${r}_mixed_cudnn.txt" 60 "${COMMON[@]}" "${CHECK[@]}" --engine cudnn \
    --ranks "$r" -b 16384 -e 16384 --docs-dist longtail --tokens-per-doc 2048 --mask mixed
done
say "loopback rows done ($(elapsed))"

# 5. compute-sanitizer memcheck on the loopback reference test (the subset of its cases).
say "## compute-sanitizer memcheck: CudaGpu.LoopbackBatchesMatchTheReference (subset)"
if [ "$DRY" = 1 ] || command -v compute-sanitizer > /dev/null; then
  run memcheck.txt 90 env HSAP_TEST_SWEEP=subset compute-sanitizer --tool memcheck \
    --print-limit 20 "$TESTS/lib_api_cuda_test" --gtest_filter=CudaGpu.LoopbackBatchesMatchTheReference
  [ "$DRY" = 1 ] || grep -E 'ERROR SUMMARY|\[  (PASSED|FAILED) ' "$RESULTS/memcheck.txt" | tee -a "$SUMMARY"
else
  say "  compute-sanitizer not found on PATH: not run"
fi

say "done in $(elapsed), status $status; results in $RESULTS"
exit $status
