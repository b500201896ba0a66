#!/usr/bin/env bash
# The GPU check: build, test (attention against the float64 reference, the transfer engine against
# the host pages), benchmark (attention, transfer paths and page cache), in one call.
#
#   scripts/gpu_check.sh stage   Here, where the project's dependencies are installed: configure
#                                build-gpu with CUDA, build the GPU test and benchmark (-j2), and
#                                stage them with the libraries the GPU machine lacks in
#                                build-gpu/stage.
#   scripts/gpu_check.sh [run]   On the GPU machine (device tool: carry build-gpu/stage): build
#                                there when the project's dependencies are installed, else use the
#                                staged binaries; then the tests (label gpu), compute-sanitizer
#                                memcheck and racecheck on a few small cases, and the benchmarks.
#                                Logs go to $OUT (or build-gpu/out); short tables come last.
#                                GPU_CHECK_BENCHES (default "attend transfer") picks the benchmarks,
#                                GPU_CHECK_TESTS (default "gpu offload") the test binaries: gpu is
#                                kvsift_gpu_tests, offload kvsift_offload_tests (the offload step
#                                against the CPU kernel; it links the whole library).
#   GPU_CHECK_BUILD (default build-gpu) is the build folder of both modes; carry its stage folder.
#
# The H200 machine's image has CUDA, CMake and ninja but not the Debian packages the project's
# configure requires (xsimd, ICU, oneDNN, GoogleTest, Google Benchmark), hence the staging. The
# gpu binaries link only the gpu objects, the float64 reference, GoogleTest (static) and Google
# Benchmark; kvsift_offload_tests links the whole library, so its shared libraries (oneDNN, OpenMP,
# OpenCL) are staged too: every library ldd names except glibc's own, which the GPU machine has.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-run}
build=${GPU_CHECK_BUILD:-build-gpu}
stage=$build/stage
benches=${GPU_CHECK_BENCHES-attend transfer}
tests=${GPU_CHECK_TESTS-gpu offload}
targets=()
[[ " $tests " == *" gpu "* ]] && targets+=(kvsift_gpu_tests)
[[ " $tests " == *" offload "* ]] && targets+=(kvsift_offload_tests)
[[ " $benches " == *" attend "* ]] && targets+=(kvsift-bench-gpu-attend)
[[ " $benches " == *" transfer "* ]] && targets+=(kvsift-bench-gpu-transfer)
# Where each target lands in the build folder.
target_path() { case $1 in kvsift-bench-*) echo "$build/bench/$1" ;; *) echo "$build/tests/$1" ;; esac; }

configure_and_build() {
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVSIFT_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="${CUDACXX:-/usr/local/cuda/bin/nvcc}" >/dev/null
  cmake --build "$build" -j2 --target "${targets[@]}"
}

if [[ $mode == stage ]]; then
  configure_and_build
  rm -rf "$stage" && mkdir -p "$stage"
  for t in "${targets[@]}"; do cp "$(target_path "$t")" "$stage/"; done
  # Shared libraries the binaries need beyond glibc: the GPU machine has no Google Benchmark,
  # oneDNN or OpenCL loader, and its own libcudart and libstdc++ may differ from the ones linked
  # here. glibc's libraries stay behind: a newer one is there.
  for t in "${targets[@]}"; do ldd "$stage/$t"; done |
    awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u |
    grep -vE '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' |
    while read -r path; do cp -L "$path" "$stage/"; done
  ls -l "$stage"
  exit 0
fi

out=${OUT:-$build/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv |
  tee "$out/gpu.txt"

if [[ -f /usr/include/gtest/gtest.h && -f /usr/include/benchmark/benchmark.h &&
  -d /usr/include/xsimd ]] && configure_and_build >"$out/build.log" 2>&1; then
  bin_test=$build/tests/kvsift_gpu_tests
  bin_offload=$build/tests/kvsift_offload_tests
  bin_bench=$build/bench/kvsift-bench-gpu-attend
  bin_transfer=$build/bench/kvsift-bench-gpu-transfer
  echo "built here"
elif [[ -x $stage/${targets[0]} ]]; then
  export LD_LIBRARY_PATH=$PWD/$stage${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  bin_test=$stage/kvsift_gpu_tests
  bin_offload=$stage/kvsift_offload_tests
  bin_bench=$stage/kvsift-bench-gpu-attend
  bin_transfer=$stage/kvsift-bench-gpu-transfer
  echo "project dependencies missing here: running the staged binaries"
else
  echo "cannot build here and no staged binaries in $stage (run 'scripts/gpu_check.sh stage')" >&2
  exit 1
fi

status=0
if [[ " $tests " == *" gpu "* ]]; then
  # The kernels' machine code, for reading without device time (this machine has no cuobjdump).
  if command -v cuobjdump >/dev/null && [[ -x $bin_bench ]]; then
    cuobjdump -sass "$bin_bench" | gzip >"$out/kernels.sass.gz" || true
  fi
  "$bin_test" --gtest_brief=1 2>&1 | tee "$out/test.log" || status=1

  small='*b1_g4_d128_p16_bf16_pages:*b4_g4_d64_p16_f16_tokens:*g12*:*short_selection*:*nothing_listed*'
  small+=':*GpuTransferCase*staged_4096*:*GpuTransferCase*mapped_8192*'
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
      compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin_test" --gtest_filter="$small" \
        --gtest_brief=1 >"$out/sanitizer_$tool.log" 2>&1 || status=1
      echo "compute-sanitizer $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' \
        "$out/sanitizer_$tool.log" | tail -1)"
    done
  fi
fi
if [[ " $tests " == *" offload "* ]]; then
  # Prints a per-call table (pages, hits, misses, refreshes, bytes, the time split) per case.
  "$bin_offload" 2>&1 | tee "$out/offload.log" || status=1
  if command -v compute-sanitizer >/dev/null; then
    compute-sanitizer --tool memcheck --error-exitcode 9 "$bin_offload" \
      --gtest_filter='*oracle_f16_b3*:OffloadTest.*' --gtest_brief=1 \
      >"$out/sanitizer_offload_memcheck.log" 2>&1 || status=1
    echo "compute-sanitizer memcheck (offload): $(grep -E 'ERROR SUMMARY' \
      "$out/sanitizer_offload_memcheck.log" | tail -1)"
  fi
fi

if [[ " $benches " == *" attend "* ]]; then
  "$bin_bench" --benchmark_repetitions=5 --benchmark_min_time=0.1 \
    --benchmark_report_aggregates_only=true --benchmark_out="$out/bench.json" \
    --benchmark_out_format=json >"$out/bench.txt" 2>&1 || status=1
fi
if [[ " $benches " == *" transfer "* ]]; then
  "$bin_transfer" --benchmark_repetitions=5 --benchmark_min_time=0.05 \
    --benchmark_report_aggregates_only=true --benchmark_out="$out/transfer.json" \
    --benchmark_out_format=json >"$out/transfer.txt" 2>&1 || status=1
fi

echo
for log in "$out/test.log" "$out/offload.log"; do
  [[ -f $log ]] && grep -E '^\[  (PASSED|FAILED)|tests? ran|worst relative error' "$log" || true
done
if [[ -f $out/bench.json ]]; then
  # Median and spread per case: time per call, TB/s of K+V, and the share of copy bandwidth.
  python3 - "$out/bench.json" <<'PY' || cat "$out/bench.txt"
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
if [[ -f $out/transfer.json ]]; then
  # Transfer paths: median GB/s with its spread, against the plain pinned copy of the same bytes;
  # the smallest size from which staging beats the mapped kernel; then the page cache.
  python3 - "$out/transfer.json" <<'PY' || cat "$out/transfer.txt"
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
