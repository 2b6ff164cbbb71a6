#!/usr/bin/env bash
# The README's test command: installs what is missing, builds, runs every test: the C++
# suites (ctest), then the Python package's (scripts/test_python.sh; it finds or creates a
# Python with torch outside the clone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh "$@"
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 600
bash scripts/test_python.sh
