#!/usr/bin/env bash
# The Python check on the GPU machine: kvsift.transformers with SmolLM2 on CUDA
# (python/tests/test_transformers.py: greedy tokens of kvsift dense against transformers' SDPA,
# LOCKS at 5% answering the demo's question) and python/examples/compare_selectors.py (its test,
# then the full table).
#
#   scripts/gpu_python_check.sh stage   Here, after scripts/setup.sh: build the module for the GPU
#                                       machine's Python (3.12: GPU_PY names an interpreter of that
#                                       version, default python3.12, for a venv with nanobind made
#                                       in build-py312/venv; or GPU_PY_VENV names a venv of 3.12
#                                       with nanobind already) in build-py312 (CUDA off:
#                                       kvsift runs on the host's CPU), and pack it, the shared
#                                       libraries it needs that the GPU image lacks and the gguf
#                                       wheel (transformers reads GGUF with it) into
#                                       .pystage/stage.tar.xz (the tests read the demo's document
#                                       from apps/common/ in the carried tree); split the model
#                                       file ($KVSIFT_MODEL) into .pystage/model.part.* of 30 MiB.
#   scripts/gpu_python_check.sh run     On the GPU machine, whose image has torch, transformers and
#                                       accelerate: carry .pystage/stage.tar.xz and the model parts
#                                       over several calls (at most 64 MiB each), back to back while
#                                       the machine is warm. A call's carry replaces the .pystage
#                                       left by the one before, so each call copies what it carried
#                                       to a folder there (`mkdir -p /tmp/kvparts && cp .pystage/*
#                                       /tmp/kvparts/`) and the last one runs this with
#                                       GPU_PY_STAGE=/tmp/kvparts. Unpacks to /tmp/kvsift-py, joins
#                                       the model, runs the tests and the example.
#
# Why a module built here: the GPU image lacks the Debian packages the library's configure needs
# (scripts/gpu_check.sh says which); the module links the library statically, so it needs only
# the few shared libraries ldd names, packed beside it. libstdc++ and libgcc_s stay the image's
# own (newer, and torch's). .pystage must be ignored by git (.git/info/exclude) to be carried.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-run}
build=${GPU_PY_BUILD:-build-py312}
stage=${GPU_PY_STAGE:-.pystage}  # run: where the carried files were gathered

if [[ $mode == stage ]]; then
  venv=${GPU_PY_VENV:-$PWD/$build/venv}
  if [[ ! -x $venv/bin/python ]]; then
    "${GPU_PY:-python3.12}" -m venv "$venv"
    "$venv/bin/pip" install -q "$(grep '^nanobind==' python/requirements-dev.txt)"
  fi
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVSIFT_ENABLE_CUDA=OFF \
    -DKVSIFT_PYTHON=ON -DPython_EXECUTABLE="$venv/bin/python" >/dev/null
  nice ninja -C "$build" -j2 kvsift_python kvsift_python_files
  rm -rf "$stage" && mkdir -p "$stage/pkg/python" "$stage/pkg/lib" "$stage/pkg/whl"
  cp -r "$build/python/kvsift" "$stage/pkg/python/"
  ldd "$build"/python/kvsift/_core.*.so | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' |
    grep -vE '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' |
    while read -r path; do cp -L "$path" "$stage/pkg/lib/"; done
  "$venv/bin/pip" download -q --no-deps -d "$stage/pkg/whl" gguf==0.19.0
  tar -cJf "$stage/stage.tar.xz" -C "$stage" pkg && rm -rf "$stage/pkg"
  split -b 30M -d "${KVSIFT_MODEL:?KVSIFT_MODEL: the model file (scripts/fetch_model.sh)}" \
    "$stage/model.part."
  ls -l "$stage"
  exit 0
fi

root=/tmp/kvsift-py
rm -rf "$root" && mkdir -p "$root"
tar -xJf "$stage/stage.tar.xz" -C "$root"
cat "$stage"/model.part.* >"$root/model.gguf"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$root/site" \
  "$root"/pkg/whl/*.whl
export PYTHONPATH=$root/pkg/python:$root/site
export LD_LIBRARY_PATH=$root/pkg/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVSIFT_MODEL=$root/model.gguf PYTHONUNBUFFERED=1
python3 -c 'import sys, torch, transformers, kvsift
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers",
      transformers.__version__, "kvsift", kvsift.__version__, kvsift.isa_supported(),
      "cuda", torch.cuda.is_available() and torch.cuda.get_device_name())'
python3 -m pytest -q -s -p no:cacheprovider python/tests/test_transformers.py \
  python/tests/test_examples.py
python3 python/examples/compare_selectors.py --model "$KVSIFT_MODEL"
