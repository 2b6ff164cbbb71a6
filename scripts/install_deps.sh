#!/usr/bin/env bash
# Installs the Debian packages hsap builds with (and python3-venv, which scripts/test_python.sh
# needs on a machine without /opt/hsap-py), when any is missing.
set -euo pipefail
pkgs=(cmake ninja-build g++ clang libabsl-dev libgtest-dev libgmock-dev nlohmann-json3-dev pkg-config
      python3 python3-venv)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi

# cuobjdump and the nvdisasm it runs (PyPI nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm): the
# variant compile test disassembles the cubins to check that the tensor-core kernels hold HMMA
# (it skips, saying so, without them). Into the project's venv when there is one, else into
# /opt/hsap-tools (--target changes nothing of the system Python, so PEP 668's guard is
# lifted for it); optional: a machine without pip access still builds and tests.
if [ -x /opt/hsap-py/bin/python ]; then
  # transformers: the HF drop-in's tests (python/tests/test_transformers.py skip without it).
  /opt/hsap-py/bin/python -c "import transformers" > /dev/null 2>&1 ||
    /opt/hsap-py/bin/python -m pip install -q transformers ||
    echo "note: transformers not installed (the HF tests will skip)"
  /opt/hsap-py/bin/python -m pip show -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm > /dev/null 2>&1 ||
    /opt/hsap-py/bin/python -m pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm ||
    echo "note: cuobjdump not installed (the HMMA check will skip)"
elif ! ls /opt/hsap-tools/nvidia/cu*/bin/nvdisasm > /dev/null 2>&1; then
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --target /opt/hsap-tools \
    nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm ||
    echo "note: cuobjdump not installed (the HMMA check will skip)"
fi
