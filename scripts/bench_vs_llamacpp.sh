#!/usr/bin/env bash
# kvsift beside llama.cpp on the same GGUF, the same prompt tokens and the same thread count, in one
# run: prefill tokens/s at 2K and 8K, decode tokens/s at 1K and 8K context (tools/peer/bench.py).
# Needs the peer's virtualenv (tools/peer/setup.sh; llama.cpp compiles from source, ~4 min) and a
# release build (make build). JSON lines on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${THREADS:-2}"
tools/peer/setup.sh >&2
exec tools/peer/.venv/bin/python tools/peer/bench.py --threads "$threads" --reps "${REPS:-3}" \
  --impl llama.cpp --impl cmd --impl-name kvsift \
  --cmd "build/bench/kvsift-bench-model --model {model} --threads {threads} --mode {case} --ctx 8192 --n-decode {n_decode} --tokens {tokens_file}" \
  "$@"
