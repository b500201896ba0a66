# The two commands of the README, and the steps behind them.
#   make demo   set up, build, run the demo on its built-in default
#   make test   set up, build, run every test (release build, then an ASan+UBSan build)
#   make bench  build and run the benchmarks (never part of make test)
#   make eval   build and run the evaluation's default suite; writes docs/RESULTS.md, docs/results/
#   make eval-full  the larger suite; writes docs/RESULTS-full.md, docs/results-full/

BUILD      ?= build
ASAN_BUILD ?= build-asan
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=

.PHONY: all deps build build-asan test test-release test-asan demo bench eval eval-full format clean

all: build

deps:
	@scripts/setup.sh

build: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

# The sanitizer build leaves CUDA out, so it also covers the build-without-CUDA entry points;
# the release build covers "CUDA built, no device".
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

test: test-release test-asan

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
	rm -rf $(BUILD) $(ASAN_BUILD)
