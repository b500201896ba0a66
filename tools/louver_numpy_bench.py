#!/usr/bin/env python3
"""The obvious Python alternative to the Louver index: numpy matmul + threshold.

For n keys of d = 128 (float32, numpy's fast BLAS path; an fp16 matrix would take numpy's slow
non-BLAS loop) and one query, times

    s = K @ q; ids = np.flatnonzero(s >= tau)

with tau the ceil(0.10 * 512)-th largest score of a 512-key random sample (the oracle
bench_louver.cpp uses, computed outside the timing). Prints median and spread (p10..p90) in
microseconds per query, to set beside kvsift-bench-louver's BM_louver_query / BM_louver_scan.

    tools/peer/.venv/bin/python tools/louver_numpy_bench.py --n 40960 131072
    OPENBLAS_NUM_THREADS=1 tools/peer/.venv/bin/python tools/louver_numpy_bench.py  # one thread
"""
import argparse
import os
import time

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[40960, 131072])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--fraction", type=float, default=0.10)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20, help="passes over the queries")
    args = parser.parse_args()
    rng = np.random.default_rng(0x6B7673696674)
    print(f"numpy {np.__version__}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'default')}")
    for n in args.n:
        keys = rng.standard_normal((n, args.d), dtype=np.float32)
        keys = keys.astype(np.float16).astype(np.float32)  # the values an fp16 cache holds
        queries = rng.standard_normal((args.queries, args.d), dtype=np.float32) * 0.3
        sample = rng.choice(n, size=min(512, n), replace=False)
        rank = int(np.ceil(args.fraction * len(sample)))
        taus = [np.partition(keys[sample] @ q, -rank)[-rank] for q in queries]
        times = []
        returned = 0
        for _ in range(args.repeats):
            for q, tau in zip(queries, taus):
                start = time.perf_counter()
                ids = np.flatnonzero(keys @ q >= tau)
                times.append(time.perf_counter() - start)
                returned += ids.size
        t = np.array(times) * 1e6
        print(f"n={n} d={args.d} f={args.fraction}: median {np.median(t):.1f} us "
              f"(p10 {np.percentile(t, 10):.1f}, p90 {np.percentile(t, 90):.1f}), "
              f"returned {returned / len(times) / n:.3f} of the keys")


if __name__ == "__main__":
    main()
