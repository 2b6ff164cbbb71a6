#!/usr/bin/env bash
# hsap_attn_perf --backend cuda-loopback where the CUDA driver cannot be loaded
# ($HSAP_CUDA_LIB_PATH at an empty directory, as on a machine without a GPU): it exits 1 with
# one line that names what is missing, before any row (so before cuDNN's forward or
# backward is tried), and --cudnn or --engine without cuda-loopback, or an --engine that is not
# auto, cudnn or jit, is a usage error (exit 2).
# Usage: attn_perf_no_gpu_test.sh HSAP_ATTN_PERF
set -uo pipefail
perf=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

mkdir "$tmp/empty"
HSAP_CUDA_LIB_PATH="$tmp/empty" "$perf" --backend cuda-loopback --ranks 1 --dtype bf16 \
  --head-dim 128 --heads 2 --kv-heads 2 -b 256 -e 256 -n 1 -w 0 > "$tmp/out" 2>&1
rc=$?
[ "$rc" = 1 ] || fail "exit $rc, want 1: $(cat "$tmp/out")"
grep -q "libcuda.so.1 not found" "$tmp/out" || fail "the missing driver is not named: $(cat "$tmp/out")"
grep -q "HSAP_CUDA_LIB_PATH" "$tmp/out" || fail "no hint at the variable: $(cat "$tmp/out")"
grep -qE '^ +256 ' "$tmp/out" && fail "a row ran without a GPU: $(cat "$tmp/out")"

"$perf" --backend host --cudnn 1 -b 64 -e 64 > "$tmp/usage" 2>&1
rc=$?
[ "$rc" = 2 ] || fail "--cudnn 1 on the host backend exits $rc, want 2"
grep -q "cuda-loopback" "$tmp/usage" || fail "the usage error does not say why: $(cat "$tmp/usage")"
"$perf" --backend cuda-loopback --engine fast -b 64 -e 64 > "$tmp/usage" 2>&1
rc=$?
[ "$rc" = 2 ] || fail "--engine fast exits $rc, want 2"
grep -q "auto, cudnn or jit" "$tmp/usage" || fail "--engine's usage error: $(cat "$tmp/usage")"
"$perf" --backend host --engine jit -b 64 -e 64 > "$tmp/usage" 2>&1
rc=$?
[ "$rc" = 2 ] || fail "--engine on the host backend exits $rc, want 2"
echo "ok"
