#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs the distributed attention bench
# (4 host ranks over packed rows of long-tailed documents, then under a hierarchical plan),
# checked against the single-device fp64 reference. Exits nonzero if any element is outside the tolerance rule
# (#wrong > 0) or anything fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
build_dir=${BUILD_DIR:-build}
bench="$build_dir/hsap_attn_perf"
# Checked rows: equal weights (bf16, GQA), then uneven weights with every mask kind (fp32).
"$bench" -b 2048 -e 4096 -f 2 --ranks 4 --docs-dist longtail --tokens-per-doc 256 \
  --heads 4 --kv-heads 2 --head-dim 64 --dtype bf16 -n 3 -w 1 -c 1 --ref-max-gflop 8
"$bench" -b 2048 -e 2048 --ranks 4 --weights 3,1,1,3 --docs-dist longtail --mask mixed \
  --tokens-per-doc 256 --heads 4 --kv-heads 4 --head-dim 64 --dtype fp32 -n 3 -w 1 -c 1 \
  --ref-max-gflop 8
# Under a plan: head-parallel groups {2,2} (uneven heads 3+1 and 2+2), sequence-aware
# sub-rings across them, every mask kind, checked.
"$bench" -b 2048 -e 2048 --ranks 4 --groups 2,2 --heads 3,1:2,2 --kv-heads 2 --docs-dist longtail \
  --mask mixed --tokens-per-doc 256 --head-dim 64 --dtype bf16 -n 3 -w 1 -c 1 --ref-max-gflop 8
# Larger rows, timed only.
"$bench" -b 8192 -e 16384 -f 2 --ranks 4 --docs-dist longtail --tokens-per-doc 512 \
  --heads 4 --kv-heads 2 --head-dim 64 --dtype bf16 -n 3 -w 1 -c 0
