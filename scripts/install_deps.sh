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
