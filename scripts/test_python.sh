#!/usr/bin/env bash
# Runs the Python package's tests (python/tests) against BUILD_DIR's libhsap.so.
# Python: $HSAP_PYTHON when set; else /opt/hsap-py when it imports torch, numpy and pytest;
# else a virtual environment OUTSIDE the clone ($HSAP_VENV, default ~/.cache/hsap/venv),
# created once with `pip install torch numpy pytest transformers` and reused (PyTorch is
# large); an interpreter we created without transformers gets it added once (the HF tests,
# python/tests/test_transformers.py, are skipped where transformers is missing).
# HSAP_SKIP_PYTHON_TESTS=1 skips them (e.g. sanitizer builds: an ASan libhsap.so cannot
# be loaded into an uninstrumented Python).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${HSAP_SKIP_PYTHON_TESTS:-0}" = 1 ]; then
  echo "python tests skipped (HSAP_SKIP_PYTHON_TESTS=1)"
  exit 0
fi
build_dir=${BUILD_DIR:-build}
healthy() { "$1" -c "import torch, numpy, pytest" >/dev/null 2>&1; }
python=${HSAP_PYTHON:-}
if [ -z "$python" ]; then
  if [ -x /opt/hsap-py/bin/python ] && healthy /opt/hsap-py/bin/python; then
    python=/opt/hsap-py/bin/python
  else
    venv=${HSAP_VENV:-$HOME/.cache/hsap/venv}
    if ! { [ -x "$venv/bin/python" ] && healthy "$venv/bin/python"; }; then
      echo "creating $venv (torch, numpy, pytest, transformers from PyPI)"
      python3 -m venv "$venv"
      "$venv/bin/python" -m pip install -q --upgrade pip
      "$venv/bin/python" -m pip install -q torch numpy pytest transformers
    fi
    python=$venv/bin/python
  fi
  # The HF tests need transformers: added once to the interpreter chosen here.
  "$python" -c "import transformers" >/dev/null 2>&1 || "$python" -m pip install -q transformers ||
    echo "note: transformers not installed (python/tests/test_transformers.py will skip)"
fi
healthy "$python" || { echo "error: $python cannot import torch, numpy and pytest" >&2; exit 1; }
export HSAP_LIBRARY=$PWD/$build_dir/libhsap.so
export HSAP_CACHE_DIR=${HSAP_CACHE_DIR:-$PWD/$build_dir/jit-cache}
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
set +e
"$python" -m pytest python/tests -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then  # pytest: no tests collected -- the suite vanished, not a pass
  echo "error: pytest collected no tests in python/tests" >&2
fi
exit $rc
