#!/usr/bin/env bash
# The README's test command: installs what is missing, builds, runs every test: the C++
# suites (ctest, scripts/run_ctest.sh: ends with the ten slowest), then the Python package's
# (scripts/test_python.sh; it finds or creates a Python with torch outside the clone). Prints
# the time of each phase at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/phases.sh
[ -n "${HSAP_PHASES_OUTER:-}" ] || trap phase_summary EXIT
phase install bash scripts/install_deps.sh
phase build bash scripts/build.sh "$@"
phase tests bash scripts/run_ctest.sh
phase python bash scripts/test_python.sh
