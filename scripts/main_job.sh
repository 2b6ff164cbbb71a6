#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs the single-device attention bench
# on packed rows, checked against the fp64 reference. Exits nonzero if any element is
# outside the tolerance rule (#wrong > 0) or anything fails.
# (To be switched to the distributed bench once it exists.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
build_dir=${BUILD_DIR:-build}
bench="$build_dir/hsap_attn_local_perf"
# Rows small enough for the fp64 reference (checked), then larger rows (timed only).
"$bench" -b 1024 -e 2048 -f 2 --docs 8 --heads 8 --kv-heads 2 --head-dim 128 --dtype bf16 \
  --mask mixed --window 256 -n 3 -w 1 -c 2 --ref-max-gflop 8
"$bench" -b 1024 -e 2048 -f 2 --docs 8 --heads 4 --kv-heads 4 --head-dim 64 --dtype fp32 \
  --mask causal -n 3 -w 1 -c 2 --ref-max-gflop 8
"$bench" -b 4096 -e 16384 -f 2 --docs 16 --heads 8 --kv-heads 2 --head-dim 128 --dtype bf16 \
  --mask causal -n 3 -w 1 -c 0
