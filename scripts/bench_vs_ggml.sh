#!/usr/bin/env bash
# kvsift beside ggml's CPU kernels in one process (bench/ggml/bench_ggml.cpp): decode attention
# (ggml_flash_attn_ext in llama.cpp's KV layout and head-major, against kvsift dense and LOCKS)
# and Q4_0/Q8_0 matrix-vector products (ggml_mul_mat against matvec_quant), same data, same
# threads. ggml comes from the llama-cpp-python sdist pinned in tools/peer/requirements.txt,
# downloaded once into a cache folder outside the tree, and compiles into its own build folder
# (~5 min on 2 cores the first time). Not part of `make test`.
#
# Writes docs/results/cpu-scale/ggml-side-by-side.json (raw) and .md (tools/peer/ggml_table.py).
# Arguments go to kvsift-bench-ggml (--contexts, --reps, --only attention|matvec, ...).
# Environment:
#   RUNS               runs, each THREADS[:OMP_WAIT_POLICY] (default "2": 2 threads, OpenMP's
#                      default waiting); "2 2:passive 1" adds ggml's threads sleeping at once
#                      when they wait, and one thread per library (no barriers at all)
#   APPEND             1: add the runs to the existing results instead of replacing them (for a
#                      case run again alone, on a quieter machine)
#   KVSIFT_PEER_CACHE  where the sdist is kept (default ${XDG_CACHE_HOME:-~/.cache}/kvsift-peer)
#   BUILD              build folder (default build-ggml)
#   REPS               samples per variant (default 11)
#   JOBS               build jobs (default 2)
#   RESULTS            output folder (default docs/results/cpu-scale)
set -euo pipefail
cd "$(dirname "$0")/.."

version="$(sed -n 's/^llama-cpp-python==//p' tools/peer/requirements.txt)"
if [ -z "$version" ]; then
  echo "bench_vs_ggml: no llama-cpp-python pin in tools/peer/requirements.txt" >&2
  exit 1
fi
cache="${KVSIFT_PEER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvsift-peer}"
sdist="$cache/llama_cpp_python-$version.tar.gz"
ggml="$cache/llama_cpp_python-$version/vendor/llama.cpp/ggml"
build="${BUILD:-build-ggml}"
results="${RESULTS:-docs/results/cpu-scale}"

mkdir -p "$cache" "$results"
if [ ! -f "$sdist" ]; then
  echo "bench_vs_ggml: downloading the llama-cpp-python $version sdist into $cache" >&2
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" \
    -d "$cache"
fi
if [ ! -f "$ggml/CMakeLists.txt" ]; then
  tar -xzf "$sdist" -C "$cache"
fi

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVSIFT_ENABLE_CUDA=OFF \
  -DKVSIFT_GGML_SOURCE_DIR="$ggml" >&2
cmake --build "$build" -j "${JOBS:-2}" --target kvsift-bench-ggml >&2

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
inputs=()
commands=()
if [ "${APPEND:-0}" = 1 ] && [ -f "$results/ggml-side-by-side.json" ]; then
  cp "$results/ggml-side-by-side.json" "$tmp/previous.json"
  inputs+=("$tmp/previous.json")
fi
n=0
for run in ${RUNS:-2}; do
  threads="${run%%:*}"
  policy=""
  [ "$run" != "$threads" ] && policy="${run#*:}"
  cmd=("$build/bench/ggml/kvsift-bench-ggml" --threads "$threads" --reps "${REPS:-11}" "$@")
  n=$((n + 1))
  if [ -n "$policy" ]; then
    OMP_WAIT_POLICY="$policy" "${cmd[@]}" --out "$tmp/run$n.json"
    commands+=(--command "OMP_WAIT_POLICY=$policy ${cmd[*]}")
  else
    "${cmd[@]}" --out "$tmp/run$n.json"
    commands+=(--command "${cmd[*]}")
  fi
  inputs+=("$tmp/run$n.json")
done
python3 tools/peer/ggml_table.py "${inputs[@]}" "${commands[@]}" \
  --json-out "$results/ggml-side-by-side.json" --md-out "$results/ggml-side-by-side.md" \
  --cpu "$(lscpu | awk -F': *' '/^Model name/ {n = $2} /^CPU family/ {f = $2} /^Model:/ {m = $2}
                             END {printf "%s (family %s, model %s)", n, f, m}'), $(nproc) CPUs"
echo "bench_vs_ggml: wrote $results/ggml-side-by-side.{json,md}" >&2
