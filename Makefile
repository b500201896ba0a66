# The two commands of the README, and the steps behind them.
#   make demo   set up, build, run the demo on its built-in default
#   make test   set up, build, run every test (release build, an ASan+UBSan build, then the
#               thread stress test under ThreadSanitizer)
#   make bench  build and run the benchmarks (never part of make test)
#   make eval   build and run the evaluation's default suite; writes docs/RESULTS.md, docs/results/
#   make eval-full  the larger suite; writes docs/RESULTS-full.md, docs/results-full/

BUILD      ?= build
ASAN_BUILD ?= build-asan
TSAN_BUILD ?= build-tsan
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
VENV       ?= .venv
PYTHON     ?= python3

.PHONY: all deps build build-asan test test-release test-asan demo bench eval eval-full format clean

all: build

deps:
	@scripts/setup.sh

# The release build also builds the Python module (python/) with the venv's nanobind.
build: deps $(VENV)/.installed
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVSIFT_PYTHON=ON \
	  -DPython_EXECUTABLE=$(CURDIR)/$(VENV)/bin/python $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

# The sanitizer build leaves CUDA out, so it also covers every device entry point without the CUDA
# backend module; the release build covers "module built, no driver or device".
build-asan: deps
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVSIFT_SANITIZE=ON \
	  -DKVSIFT_ENABLE_CUDA=OFF -DKVSIFT_BUILD_BENCH=OFF -DKVSIFT_BUILD_APPS=OFF $(CMAKE_ARGS)
	cmake --build $(ASAN_BUILD) -j $(JOBS)

# Tests that need the real model read KVSIFT_MODEL (they skip without it; make test always sets it).
test-release: build
	KVSIFT_MODEL="$$(scripts/fetch_model.sh)" ctest --test-dir $(BUILD) --output-on-failure

test-asan: build-asan
	KVSIFT_MODEL="$$(scripts/fetch_model.sh)" \
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --test-dir $(ASAN_BUILD) --output-on-failure

# ThreadSanitizer on the one binary that exists for it (tests/test_thread_stress.cpp: 8 caches,
# then 8 models, on 8 threads, bit for bit against serial), so the build stays a few minutes. It
# runs with no OMP_* variable and no suppressions; the uninstrumented parts:
# - OpenMP: lib/ is compiled without -fopenmp (its loops run on lib/core/thread_pool.hpp, which
#   is instrumented), and oneDNN is called from the pool with the thread's OpenMP count at 1
#   (lib/core/matmul.cpp), so libgomp never starts a team and its barriers never run.
# - oneDNN (Debian's build): TSan sees its allocations, copies and pthread locks but not its
#   atomics. kvsift creates primitives under one lock (lib/core/matmul.cpp; without it this test
#   reports a race in oneDNN's primitive cache) and hands each product's slices to the pool's
#   threads through the pool's instrumented atomics, each thread with its own stream and
#   scratchpad, so every order between threads that touch oneDNN's objects is one TSan sees.
.PHONY: build-tsan test-tsan
build-tsan: deps
	cmake -S . -B $(TSAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVSIFT_TSAN=ON \
	  -DKVSIFT_ENABLE_CUDA=OFF -DKVSIFT_BUILD_BENCH=OFF -DKVSIFT_BUILD_APPS=OFF $(CMAKE_ARGS)
	cmake --build $(TSAN_BUILD) -j $(JOBS) --target kvsift_thread_stress_tests

test-tsan: build-tsan
	$(TSAN_BUILD)/tests/kvsift_thread_stress_tests

test: test-release test-asan test-tsan

# The Python tools (python/requirements-dev.txt, pinned) in a git-ignored venv, from PyPI.
$(VENV)/.installed: python/requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r python/requirements-dev.txt
	touch $@

# The Python package against numpy float64 references and the C API's own results; the model
# tests compare with the demo built beside it.
.PHONY: test-python
test-python: build
	KVSIFT_MODEL="$$(scripts/fetch_model.sh)" KVSIFT_DEMO=$(BUILD)/apps/kvsift-demo \
	PYTHONPATH=$(BUILD)/python $(VENV)/bin/python -m pytest -q python/tests
test: test-python

demo: build
	KVSIFT_MODEL="$$(scripts/fetch_model.sh)" $(BUILD)/apps/kvsift-demo

bench: build
	$(BUILD)/bench/kvsift-bench-attend --benchmark_repetitions=5 --benchmark_report_aggregates_only=true

# The evaluation (apps/eval): generated tasks through every selector and budget, against dense and
# exact attention. EVAL_ARGS adds kvsift-eval flags (e.g. EVAL_ARGS='--tasks mine.jsonl').
# Passive OpenMP waiting: on a machine shared with other builds, spinning threads made a 4 s
# sample take 60-100 s; passive costs about 7% when the machine is otherwise idle.
EVAL_ARGS ?=
EVAL_ENV   = KVSIFT_MODEL="$$(scripts/fetch_model.sh)" OMP_WAIT_POLICY=passive
EVAL_RUN   = $(EVAL_ENV) $(BUILD)/apps/eval/kvsift-eval --source "$$(git describe --always --dirty 2>/dev/null)"
eval: build
	$(EVAL_RUN) --suite default \
	  --json docs/results/eval.json --plots docs/results --results docs/RESULTS.md $(EVAL_ARGS)

eval-full: build
	$(EVAL_RUN) --suite full \
	  --json docs/results-full/eval.json --plots docs/results-full --results docs/RESULTS-full.md \
	  $(EVAL_ARGS)

format:
	git ls-files '*.cpp' '*.hpp' '*.h' '*.c' '*.cu' | xargs clang-format -i

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD)
