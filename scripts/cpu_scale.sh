#!/usr/bin/env bash
# Decode at long contexts on the CPU, on a Llama-3.1-8B-shaped model with seeded random weights:
# generates the Q4_0 GGUF (tools/synthetic_model/make_model.py), then runs kvsift-bench-decode
# --fill synthetic once per context under /usr/bin/time -v (the process's peak resident size as
# the kernel counts it from outside), and writes the raw rows and a markdown table
# (tools/scale_table.py) to docs/results/cpu-scale/. The context is filled with structured K/V
# through kvsift_model_sequence_append_kv, not a prefill (128K tokens through 8B on two cores would
# take hours); every decode step is the whole model's.
#
# Memory: the KV cache of one 8B sequence takes 128 KiB a token in f16 (32 layers, 8 KV heads,
# 128 channels, K and V: 17.2 GB at 128K) and 66 KiB in q8 (int8 codes and a float32 scale per
# row, simd/page_layout.hpp: 8.9 GB at 128K), beside 4.5 GB of Q4_0 weights.
#
# Environment:
#   MODEL_DIR  where the GGUF is written (default /tmp); reused when it exists
#   SHAPE      make_model.py's shape (default llama3-8b; llama3.2-1b or smollm2-135m to try it)
#   CONTEXTS   default 32768,65536,131072
#   SELECTORS  default dense,locks,louver       BUDGETS  default 0.02,0.05
#   STEPS      timed steps per row (default 16)  WARMUP   untimed steps first (default 2)
#   WEIGHTS    bf16, f32 or quantized (default quantized: the file's Q4_0 blocks)
#   KV_DTYPE   f16, bf16 or q8 (default q8)      THREADS  0: every CPU (default)
#   PYTHON     a Python with the gguf pin (default .venv/bin/python, which `make` builds)
#   BUILD      the build folder with bench/kvsift-bench-decode (default build)
#   OUT_DIR    default docs/results/cpu-scale
set -euo pipefail
cd "$(dirname "$0")/.."

shape=${SHAPE:-llama3-8b}
model_dir=${MODEL_DIR:-/tmp}
contexts=${CONTEXTS:-32768,65536,131072}
selectors=${SELECTORS:-dense,locks,louver}
budgets=${BUDGETS:-0.02,0.05}
steps=${STEPS:-16}
warmup=${WARMUP:-2}
weights=${WEIGHTS:-quantized}
kv_dtype=${KV_DTYPE:-q8}
threads=${THREADS:-0}
python=${PYTHON:-.venv/bin/python}
build=${BUILD:-build}
out=${OUT_DIR:-docs/results/cpu-scale}
bench=$build/bench/kvsift-bench-decode

[[ -x $bench ]] || { echo "cpu_scale.sh: $bench is missing: build it first" >&2; exit 2; }
if [[ ! -x /usr/bin/time ]]; then
  echo "cpu_scale.sh: /usr/bin/time is missing (apt install time)" >&2
  exit 2
fi
model=$model_dir/$shape-q4_0.gguf
if [[ ! -s $model ]]; then
  [[ -x $python ]] || { echo "cpu_scale.sh: $python is missing (PYTHON=...)" >&2; exit 2; }
  echo "cpu_scale.sh: writing $model" >&2
  "$python" tools/synthetic_model/make_model.py --shape "$shape" --type q4_0 --seed 1 \
    --out "$model.part"
  mv "$model.part" "$model"
fi

mkdir -p "$out"
raw=$out/raw
rm -rf "$raw" && mkdir -p "$raw"
# One process per context: the peak resident size /usr/bin/time reports is that context's. A
# context that fails (out of memory at 128K, say) keeps the rows it finished, and the others run.
status=0
IFS=, read -r -a context_list <<< "$contexts"
for context in "${context_list[@]}"; do
  args=(--model "$model" --fill synthetic --contexts "$context" --batches 1
        --selectors "$selectors" --budgets "$budgets" --steps "$steps" --warmup "$warmup"
        --weights "$weights" --kv-dtype "$kv_dtype" --threads "$threads")
  echo "cpu_scale.sh: $bench ${args[*]}" >&2
  printf '%s\n' "$bench ${args[*]}" > "$raw/command_$context.txt"
  /usr/bin/time -v -o "$raw/time_$context.txt" "$bench" "${args[@]}" \
    > "$raw/rows_$context.jsonl" 2> >(tee "$raw/table_$context.txt" >&2) || {
    echo "cpu_scale.sh: context $context failed; its rows so far are kept" >&2
    status=1
  }
done
source=$(git describe --always --dirty 2>/dev/null || echo unknown)
python3 tools/scale_table.py --raw "$raw" --model "$model" --shape "$shape" \
  --source "$source" > "$out/RESULTS.md"
echo "cpu_scale.sh: $out/RESULTS.md" >&2
exit $status
