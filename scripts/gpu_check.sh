#!/usr/bin/env bash
# The GPU check: every GPU test binary, the offload demo against the CPU demo, and the GPU
# benchmarks, in as few device calls as the carry limit allows.
#
#   scripts/gpu_check.sh stage   Here, where the project's dependencies are installed: build the GPU
#                                targets in build-gpu (CUDA on, -j2; for sm_90 alone unless
#                                GPU_CHECK_CUDA_ARCHITECTURES names others) and pack them, the
#                                libraries beside them (libkvsift.so.0 and the CUDA backend module
#                                libkvsift_cuda.so, where the loader looks first) and the shared
#                                libraries the GPU machine lacks into build-gpu/stage.tar.xz (the
#                                demo's document is compiled into the binaries); split the model
#                                file ($KVSIFT_MODEL) into build-gpu/model.part.* of 30 MiB each.
#   scripts/gpu_check.sh run     On the GPU machine. Carry build-gpu/stage.tar.xz and the model
#                                parts over several calls (each call carries at most 64 MiB;
#                                ignored files stay on a warm machine between calls; a call may run
#                                `true` just to carry a part). Unpacks, joins the model, then runs
#                                what GPU_CHECK picks (default "tests demo"):
#                                  tests    the gpu-labelled test binaries (attention, transfer,
#                                           device Llama, Louver filter, LOCKS selection, offload
#                                           step, the model and the C API in offload mode), the
#                                           device model-runner tests of kvsift_tests,
#                                           compute-sanitizer on small cases
#                                  demo     kvsift-demo on the CPU and with --device cuda: dense
#                                           greedy tokens compared over 64 tokens, LOCKS at 5%
#                                  louver   Louver's filter pass, CPU against device
#                                  kernels  the attention and transfer benchmarks
#                                  throughput  decode tokens/s of the model at 1K and 8K context,
#                                           batch 1 and 8, dense and LOCKS at 5%, on the CPU's
#                                           cores and in offload mode (kvsift-bench-decode)
#                                  eval     kvsift-eval on the host's CPU cores: one process per
#                                           task of EVAL_TASKS, each with the arguments in
#                                           EVAL_ARGS and an equal share of the cores; each
#                                           writes eval_<task>.json and RESULTS_<task>.md
#                                Summaries are printed; the logs come back as $OUT/logs.tar.gz.
#
# Why staging: the GPU machine's image has CUDA, CMake and ninja but not the Debian packages the
# project's configure requires (xsimd, ICU, oneDNN, GoogleTest, Google Benchmark). Every library
# ldd names is staged except glibc's own and cuBLAS (0.6 GB; the image's CUDA 13 has it).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-run}
build=${GPU_CHECK_BUILD:-build-gpu}
stage=$build/stage
targets=(kvsift_cuda kvsift_gpu_tests kvsift_gpu_llama_tests kvsift_gpu_louver_tests
  kvsift_gpu_locks_tests kvsift_offload_tests kvsift_tests kvsift_backend_loader_tests
  kvsift-demo kvsift-bench-gpu-attend kvsift-bench-gpu-transfer kvsift-bench-gpu-louver
  kvsift-bench-offload kvsift-bench-decode kvsift-eval)
target_path() {
  case $1 in
    kvsift_cuda) echo "$build/lib/libkvsift_cuda.so" ;;
    kvsift-bench-*) echo "$build/bench/$1" ;;
    kvsift-demo) echo "$build/apps/$1" ;;
    kvsift-eval) echo "$build/apps/eval/$1" ;;
    *) echo "$build/tests/$1" ;;
  esac
}

if [[ $mode == stage ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVSIFT_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="${CUDACXX:-/usr/local/cuda/bin/nvcc}" \
    -DCMAKE_CUDA_ARCHITECTURES="${GPU_CHECK_CUDA_ARCHITECTURES:-90}" >/dev/null
  cmake --build "$build" -j2 --target "${targets[@]}"
  rm -rf "$stage" && mkdir -p "$stage"
  for t in "${targets[@]}"; do cp "$(target_path "$t")" "$stage/"; done
  for t in "${targets[@]}"; do ldd "$stage/$(basename "$(target_path "$t")")"; done |
    awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u |
    grep -vE '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so|/libcublas' |
    while read -r path; do cp -L "$path" "$stage/"; done
  tar -cJf "$build/stage.tar.xz" -C "$build" stage
  rm -f "$build"/model.part.*
  if [[ -n ${KVSIFT_MODEL:-} && -f $KVSIFT_MODEL ]]; then
    split -b 30M -d "$KVSIFT_MODEL" "$build/model.part."
  fi
  ls -l "$build/stage.tar.xz" "$build"/model.part.* 2>/dev/null
  exit 0
fi

# Logs go to $out/logs and come back packed (the device tool returns a few files per call): the
# summaries printed here, then logs.tar.gz.
out=${OUT:-$build/out}
logs=$out/logs
mkdir -p "$logs"
trap 'tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$logs"' EXIT
checks=${GPU_CHECK-tests demo}
if [[ -f $build/stage.tar.xz ]]; then
  rm -rf "$stage" && tar -xJf "$build/stage.tar.xz" -C "$build"
fi
[[ -x $stage/kvsift_gpu_tests && -f $stage/libkvsift_cuda.so ]] || {
  echo "no staged binaries or CUDA backend in $stage (run 'scripts/gpu_check.sh stage' here and" \
    "carry them)" >&2
  exit 1
}
# cuBLAS from the image's CUDA (or from PyTorch's wheel when the toolkit's folder lacks it).
cublas=$(ls /usr/local/cuda/lib64/libcublas.so.13 2>/dev/null ||
  find / -name 'libcublas.so.13' -not -path '/proc/*' -print -quit 2>/dev/null || true)
export LD_LIBRARY_PATH=$PWD/$stage${cublas:+:$(dirname "$cublas")}
if compgen -G "$build/model.part.*" >/dev/null; then
  cat "$build"/model.part.* >"$build/model.gguf"
  export KVSIFT_MODEL=$PWD/$build/model.gguf
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$logs/gpu.txt"
nproc | sed 's/^/cpu cores: /'
# The binaries load the CUDA backend beside them; a module that does not load says why here.
"$stage/kvsift_backend_loader_tests" --gtest_brief=1 \
  --gtest_filter=BackendLoader.finds_the_module_of_this_build 2>&1 | grep -E 'PASSED|FAILED|Failure|not' || true
echo "model: ${KVSIFT_MODEL:-absent} $(stat -c %s "${KVSIFT_MODEL:-/dev/null}" 2>/dev/null)"

status=0
if [[ " $checks " == *" tests "* ]]; then
  # GPU_CHECK_FILTER: a gtest filter for every binary (and no sanitizer runs).
  for t in kvsift_gpu_tests kvsift_gpu_llama_tests kvsift_gpu_louver_tests kvsift_gpu_locks_tests \
    kvsift_offload_tests; do
    # Whole output (not --gtest_brief): where a binary dies, its last RUN line names the test.
    rc=0
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} "$stage/$t" \
      --gtest_filter="${GPU_CHECK_FILTER:-*}" >"$logs/$t.log" 2>&1 || rc=$?
    ((rc == 0)) || status=1
    echo "$t: $(grep -E '^\[  (PASSED|FAILED)' "$logs/$t.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED|Failure|error' "$logs/$t.log" | head -20 || true
    if ((rc != 0)) && ! grep -qE '^\[  (PASSED|FAILED)' "$logs/$t.log"; then
      echo "  exit $rc before the summary, in $(grep -E '^\[ RUN' "$logs/$t.log" | tail -n 1)"
    fi
  done
  # The CPU suite's tests that compare the device model runner with the CPU one.
  "$stage/kvsift_tests" --gtest_brief=1 --gtest_filter='ModelTest.*device*' \
    >"$logs/kvsift_tests_device.log" 2>&1 || status=1
  echo "kvsift_tests (ModelTest.*device*): $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' \
    "$logs/kvsift_tests_device.log" | tr '\n' ' ')"
  if [[ -z ${GPU_CHECK_FILTER:-} ]] && command -v compute-sanitizer >/dev/null; then
    run_sanitizer() {  # tool binary filter
      compute-sanitizer --tool "$1" --error-exitcode 9 "$stage/$2" --gtest_filter="$3" \
        --gtest_brief=1 >"$logs/sanitizer_$1_$2.log" 2>&1 || status=1
      echo "compute-sanitizer $1 $2: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' \
        "$logs/sanitizer_$1_$2.log" | tail -2 | tr '\n' ' ')"
    }
    # The attention kernel under every tuning the benchmarks sweep, both row layouts; the
    # transfer engine's plan() and move() with extra moves on every path.
    run_sanitizer memcheck kvsift_gpu_tests '*every_split_tuning*:Paths/GpuTransferCase.*'
    run_sanitizer racecheck kvsift_gpu_tests \
      '*b1_g4_d128_p16_bf16_pages*:*b1_g4_d64_p16_q8_tokens*:*short_selection*'
    run_sanitizer memcheck kvsift_gpu_llama_tests '*'
    run_sanitizer racecheck kvsift_gpu_llama_tests '*whole*'
    run_sanitizer memcheck kvsift_gpu_louver_tests 'LouverFilter.*'
    run_sanitizer racecheck kvsift_gpu_louver_tests 'LouverFilter.device*'
    run_sanitizer memcheck kvsift_offload_tests \
      'OffloadTest.token_rows*:OffloadTest.a_step*:OffloadTest.dense_calls*'
    run_sanitizer memcheck kvsift_gpu_locks_tests '*'
    run_sanitizer racecheck kvsift_gpu_locks_tests 'LocksScorer.*'
  fi
fi

if [[ " $checks " == *" demo "* ]]; then
  demo() {  # name args...
    local name=$1
    shift
    "$stage/kvsift-demo" "$@" >"$logs/demo_$name.txt" 2>"$logs/demo_$name.err" || status=1
  }
  demo cpu_dense --max-new 64 --ignore-end --print-tokens
  demo cuda_dense --max-new 64 --ignore-end --print-tokens --device cuda
  demo cuda_locks --selector locks --budget 0.05 --device cuda
  for f in cpu_dense cuda_dense; do
    grep -E '^answer token ids' "$logs/demo_$f.txt" | sed "s/^/$f /" >"$logs/tokens_$f.txt" || true
  done
  if [[ -s $logs/tokens_cpu_dense.txt ]] && cmp -s <(cut -d' ' -f2- "$logs/tokens_cpu_dense.txt") \
    <(cut -d' ' -f2- "$logs/tokens_cuda_dense.txt"); then
    echo "demo dense: the same 64 greedy tokens on the CPU and with --device cuda"
  else
    echo "demo dense: the tokens DIFFER between the CPU and --device cuda (or a run failed)"
    status=1
  fi
  for f in cpu_dense cuda_dense cuda_locks; do
    echo "--- demo $f"
    grep -E '^A:|^prefill|^decode|^attention on|^last step|^PCIe|^KV read' "$logs/demo_$f.txt" ||
      tail -3 "$logs/demo_$f.err"
  done
fi

if [[ " $checks " == *" throughput "* ]]; then
  for device in cpu cuda; do
    "$stage/kvsift-bench-decode" --model "${KVSIFT_MODEL:-missing}" --device "$device" \
      >"$logs/throughput_$device.jsonl" 2>"$logs/throughput_$device.err" || status=1
  done
  # One row per (selector, context, batch): tokens/s in both modes (median step; the spread is the
  # fastest and slowest step's), the offload/CPU ratio, and the offload step's split.
  python3 - "$logs/throughput_cpu.jsonl" "$logs/throughput_cuda.jsonl" <<'PY' ||
import json, sys
rows = [{}, {}]
for i, path in enumerate(sys.argv[1:3]):
    for line in open(path):
        if line.startswith("{"):
            r = json.loads(line)
            rows[i][(r["selector"], r["context"], r["batch"])] = r
print(f"{'selector':8} {'ctx':>5} {'batch':>5} {'cpu tok/s':>14} {'cuda tok/s':>16} {'x':>6} "
      f"{'select_us':>9} {'xfer_us':>8} {'attend_us':>9} {'MB/step':>8} {'hit':>5}")
for key, c in rows[0].items():
    g = rows[1].get(key)
    if g is None:
        continue
    spread = lambda r: f"{r['tok_s']:.1f} ({r['batch'] * 1e3 / r['step_ms_max']:.0f}-{r['batch'] * 1e3 / r['step_ms_min']:.0f})"
    print(f"{key[0]:8} {key[1]:5} {key[2]:5} {spread(c):>14} {spread(g):>16} "
          f"{g['tok_s'] / c['tok_s']:6.2f} {g['select_us']:9.0f} {g['transfer_us']:8.0f} "
          f"{g['attend_us']:9.0f} {g['h2d_MB']:8.2f} {g['hit_rate']:5.3f}")
PY
    { cat "$logs"/throughput_*.err; status=1; }
fi

if [[ " $checks " == *" eval "* ]]; then
  # The tasks run side by side: one process's decode steps are too small to keep 16 cores busy.
  read -ra tasks <<<"${EVAL_TASKS:?eval needs EVAL_TASKS, e.g. niah_single_noise niah_multikey}"
  threads=$(($(nproc) / ${#tasks[@]}))
  ((threads > 0)) || threads=1
  pids=()
  for task in "${tasks[@]}"; do
    # shellcheck disable=SC2086  # EVAL_ARGS is a list of arguments
    "$stage/kvsift-eval" --task-names "$task" ${EVAL_ARGS:-} --threads "$threads" \
      --json "$logs/eval_$task.json" --results "$logs/RESULTS_$task.md" \
      >"$logs/eval_$task.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { status=1; tail -3 "$logs/eval_${tasks[$i]}.log"; }
  done
  for task in "${tasks[@]}"; do tail -1 "$logs/eval_$task.log"; done
fi

if [[ " $checks " == *" louver "* ]]; then
  "$stage/kvsift-bench-gpu-louver" --benchmark_repetitions=3 --benchmark_min_time=0.05 \
    --benchmark_report_aggregates_only=true >"$logs/bench_louver.txt" 2>&1 || status=1
  grep -E 'median' "$logs/bench_louver.txt" | head -40 || true
fi
if [[ " $checks " == *" kernels "* ]]; then
  "$stage/kvsift-bench-gpu-attend" --benchmark_repetitions=5 --benchmark_min_time=0.1 \
    --benchmark_report_aggregates_only=true --benchmark_out="$logs/bench.json" \
    --benchmark_out_format=json >"$logs/bench.txt" 2>&1 || status=1
  "$stage/kvsift-bench-gpu-transfer" --benchmark_repetitions=5 --benchmark_min_time=0.05 \
    --benchmark_report_aggregates_only=true --benchmark_out="$logs/transfer.json" \
    --benchmark_out_format=json >"$logs/transfer.txt" 2>&1 || status=1
fi

echo
if [[ -f $logs/bench.json ]]; then
  # Median and spread per case: time per call, TB/s of K+V, and the share of copy bandwidth.
  python3 - "$logs/bench.json" <<'PY' || cat "$logs/bench.txt"
import json, sys
runs = json.load(open(sys.argv[1]))["benchmarks"]
by = {}
for r in runs:
    by.setdefault(r["run_name"], {})[r.get("aggregate_name", "")] = r
print(f"{'case':58} {'us/call':>8} {'min':>8} {'max':>8} {'TB/s':>6} {'of_copy':>7} {'splits':>6}")
for name, agg in by.items():
    med, lo, hi = agg.get("median"), agg.get("min"), agg.get("max")
    if med is None:
        continue
    print(f"{name:58} {med['real_time']:8.1f} {lo['real_time']:8.1f} {hi['real_time']:8.1f} "
          f"{med.get('TBps', 0):6.2f} {med.get('of_copy', 0):7.2f} {med.get('splits', 0):6.0f}")
PY
fi
if [[ -f $logs/transfer.json ]]; then
  # Transfer paths: median GB/s with its spread, against the plain pinned copy of the same bytes;
  # the smallest size from which staging beats the mapped kernel; then the page cache.
  python3 - "$logs/transfer.json" <<'PY' || cat "$logs/transfer.txt"
import json, sys
runs = json.load(open(sys.argv[1]))["benchmarks"]
by = {}
for r in runs:
    by.setdefault(r["run_name"], {})[r.get("aggregate_name", "")] = r
table = {}
print(f"{'path':13} {'page':>5} {'pages':>5} {'MiB':>7} {'us':>8} {'GB/s':>6} {'min':>6} {'max':>6} "
      f"{'copy':>6} {'of_copy':>7}")
for name, agg in by.items():
    if not name.startswith("BM_gpu_transfer/") or "median" not in agg:
        continue
    _, path, page, pages = name.split("/")[:4]
    page, pages = int(page.split(":")[1]), int(pages.split(":")[1])
    med, lo, hi = agg["median"], agg["min"], agg["max"]
    mib = page * pages / 2**20
    table[(path, page, pages)] = med["real_time"]
    # The fastest repetition gives the highest GB/s.
    print(f"{path:13} {page:5} {pages:5} {mib:7.2f} {med['real_time']:8.1f} {med['GBps']:6.1f} "
          f"{med['bytes'] / hi['real_time'] * 1e-3:6.1f} {med['bytes'] / lo['real_time'] * 1e-3:6.1f} "
          f"{med['copy_GBps']:6.1f} {med['of_copy']:7.2f}")
for page in sorted({k[1] for k in table}):
    sizes = sorted({k[2] for k in table if k[1] == page})
    wins = [n for n in sizes if table.get(("staged", page, n), 1e30) < table.get(("mapped", page, n), 0)]
    first = next((n for n in sizes if all(m in wins for m in sizes if m >= n)), None)
    if first is None:
        print(f"page {page}: no size from which staging stays faster (faster at {wins or 'none'})")
    else:
        print(f"page {page}: staged faster than mapped from {first} pages ({first * page} bytes)")
for name, agg in by.items():
    if name.startswith("BM_page_gather/") and "median" in agg:
        med = agg["median"]
        print(f"{name:52} {med['real_time']:8.1f} us {med['GBps']:6.1f} GB/s")
print(f"{'page cache case':44} {'hit':>6} {'MB/step':>8} {'overlap':>7} {'us/step':>8}")
for name, agg in by.items():
    r = agg.get("median") or agg.get("")
    if r is None or not name.startswith(("BM_page_cache", "BM_gpu_transfer_decode")):
        continue
    hit = r.get("hit_rate", r.get("hit_rate_all", 0))
    print(f"{name:44} {hit:6.3f} {r['MB_per_step']:8.3f} {r.get('overlap', 0):7.3f} "
          f"{r['us_per_step']:8.1f}")
PY
fi
exit $status
