#!/usr/bin/env bash
# Decode at long contexts on one GPU with the KV cache in host memory, for a Llama-3.1-8B-shaped
# model with seeded random bf16 weights, against the same model with every KV page in device
# memory. On the GPU machine, after `scripts/gpu_check.sh run` unpacked the staged binaries
# ($BUILD/stage) and joined the SmolLM2 file ($BUILD/model.gguf, whose tokenizer the synthetic
# model takes).
#
# The model file (16 GB) cannot be carried to that machine, so it is written there by
# tools/synthetic_model/make_model.py, with the gguf wheel carried beside the stage
# ($BUILD/wheels/gguf-*.whl: `pip download gguf==<the pin> --no-deps -d $BUILD/wheels` here)
# installed into a folder of its own; the file is kept in MODEL_DIR for later calls. Random
# weights: the text is meaningless, the timings and the memory are real.
#
# Rows, each a kvsift-bench-decode row (--fill synthetic: K/V appended straight into the host
# cache, then whole-model decode steps on the device):
#   hbm    dense attention with the device holding a copy of the whole cache
#          (--device-cache-pages 0): after the first step every page is resident in HBM and a step
#          sends only the pages that changed, the baseline
#   host   the SELECTORS at BUDGETS with the device cache bounded to CACHE_FRACTION of a layer's
#          pages: the KV cache lives in host memory and only selected pages cross PCIe; once per
#          SELECT_ON place (cpu, device: where LOCKS and Louver select)
# Raw rows (JSON lines), the tables, the commands and RESULTS.md (tools/scale_table.py) go to
# $OUT/gpu-scale (OUT defaults to $BUILD/out).
#
# Environment: CONTEXTS (default 32768,131072), BATCHES (default 1), SELECTORS (default locks),
# BUDGETS (default 0.02,0.05), SELECT_ON (default cpu,device), CACHE_FRACTION (default 0.1), STEPS
# (default 16), WARMUP (default 4), KV_DTYPE (default f16), MODEL_DIR (default /tmp/kvsift-models),
# BUILD (default build-gpu), TOKENIZER (a GGUF file with SmolLM2's tokenizer, default
# $BUILD/model.gguf), HBM (default 1; 0 skips the hbm rows), APPEND (default 0; 1 keeps the
# rows of earlier calls, for a matrix run over several calls).
set -euo pipefail
cd "$(dirname "$0")/.."

build=${BUILD:-build-gpu}
stage=$build/stage
contexts=${CONTEXTS:-32768,131072}
batches=${BATCHES:-1}
selectors=${SELECTORS:-locks}
budgets=${BUDGETS:-0.02,0.05}
select_on=${SELECT_ON:-cpu,device}
hbm=${HBM:-1}
cache_fraction=${CACHE_FRACTION:-0.1}
steps=${STEPS:-16}
warmup=${WARMUP:-4}
kv_dtype=${KV_DTYPE:-f16}
model_dir=${MODEL_DIR:-/tmp/kvsift-models}
out=${OUT:-$build/out}/gpu-scale
bench=$stage/kvsift-bench-decode
[[ -x $bench ]] || { echo "gpu_scale.sh: no $bench (run scripts/gpu_check.sh run first)" >&2; exit 2; }
export LD_LIBRARY_PATH=$PWD/$stage${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
mkdir -p "$out" "$model_dir"

model=$model_dir/llama3-8b-bf16.gguf
if [[ ! -s $model ]]; then
  wheel=$(ls "$build"/wheels/gguf-*.whl 2>/dev/null | head -n 1)
  [[ -n $wheel ]] || { echo "gpu_scale.sh: no gguf wheel in $build/wheels" >&2; exit 2; }
  pylib=$model_dir/python
  python3 -m pip install --quiet --no-deps --target "$pylib" "$wheel"
  start=$SECONDS
  # 1M positions: the 512K and 1M rows run past Llama 3.1's published 128K window.
  PYTHONPATH=$pylib python3 tools/synthetic_model/make_model.py --shape llama3-8b --type bf16 \
    --seed 1 --context-length 1048576 --tokenizer-from "${TOKENIZER:-$build/model.gguf}" \
    --out "$model"
  echo "gpu_scale.sh: wrote $model in $((SECONDS - start)) s" >&2
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt"
status=0
run() {  # name, then kvsift-bench-decode's arguments
  local name=$1
  shift
  printf '%s\n' "$bench $*" >> "$out/commands.txt"
  "$bench" --model "$model" --device cuda:0 --fill synthetic --kv-dtype "$kv_dtype" \
    --steps "$steps" --warmup "$warmup" "$@" >> "$out/rows_$name.jsonl" \
    2> >(tee -a "$out/table_$name.txt" >&2) || status=1
}
[[ ${APPEND:-0} == 1 ]] || rm -f "$out"/rows_*.jsonl "$out"/table_*.txt "$out/commands.txt"
IFS=, read -r -a context_list <<< "$contexts"
IFS=, read -r -a batch_list <<< "$batches"
IFS=, read -r -a place_list <<< "$select_on"
for context in "${context_list[@]}"; do
  for batch in "${batch_list[@]}"; do
    # A layer's (page, KV head) slots at this context and batch: 8 KV heads, 16-token pages.
    pages=$(python3 -c "import math; print(max(1, math.ceil($cache_fraction * $batch * 8 * \
math.ceil($context / 16))))")
    [[ $hbm == 0 ]] ||
      run hbm --contexts "$context" --batches "$batch" --selectors dense --device-cache-pages 0
    for place in "${place_list[@]}"; do
      # Dense takes no budget: with CACHE_FRACTION 1 it is the dense row through the page cache.
      budget_args=(--budgets "$budgets")
      [[ $selectors == dense ]] && budget_args=()
      run "host_$place" --contexts "$context" --batches "$batch" --selectors "$selectors" \
        "${budget_args[@]}" --select-on "$place" --device-cache-pages "$pages"
    done
  done
done
machine="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), host $(nproc) CPUs"
python3 tools/scale_table.py --raw "$out" --model "$model" --shape llama3-8b \
  --title "Decode at long contexts on one GPU, KV cache in host memory" --machine "$machine" \
  --source "$(git describe --always --dirty 2>/dev/null || echo unknown)" > "$out/RESULTS.md"
exit $status
