#!/usr/bin/env bash
# Creates tools/peer/.venv with llama-cpp-python (built from source) and numpy.
# Idempotent: does nothing when the venv exists and imports the pinned versions.
# Environment:
#   PYTHON                      interpreter for the venv (default python3, needs >= 3.9)
#   CMAKE_ARGS                  extra CMake flags for the llama.cpp build
#                               (default: -DLLAVA_BUILD=OFF; GGML_NATIVE stays at its default ON,
#                               i.e. -march=native, which is what the peer should be on this machine)
#   CMAKE_BUILD_PARALLEL_LEVEL  build jobs (default 2)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv"
req="$here/requirements.txt"
want_lcp="$(sed -n 's/^llama-cpp-python==//p' "$req")"
want_np="$(sed -n 's/^numpy==//p' "$req")"

ready() {
  [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$want_lcp" "$want_np" <<'PY' 2>/dev/null
import sys
import llama_cpp, numpy
sys.exit(0 if (llama_cpp.__version__, numpy.__version__) == (sys.argv[1], sys.argv[2]) else 1)
PY
}

if ready; then
  echo "peer/setup: $venv ready (llama-cpp-python $want_lcp, numpy $want_np)"
  exit 0
fi

"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
start=$(date +%s)
echo "peer/setup: installing requirements (llama.cpp compiles from source, ~10 min on 2 cores)" >&2
CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" \
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
  "$venv/bin/python" -m pip install --no-cache-dir -r "$req"
echo "peer/setup: install took $(( $(date +%s) - start )) s" >&2
ready || { echo "peer/setup: venv does not import the pinned versions" >&2; exit 1; }
echo "peer/setup: $venv ready (llama-cpp-python $want_lcp, numpy $want_np)"
