#!/usr/bin/env python3
"""The markdown table of scripts/cpu_scale.sh: kvsift-bench-decode's JSON rows
(rows_<context>.jsonl) and /usr/bin/time -v's report of each process (time_<context>.txt) from one
raw folder, printed on stdout. Standard library only."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys

NOTE = (
    "The weights are seeded random numbers (tools/synthetic_model/make_model.py), so the text "
    "the model writes is meaningless; the timings and the memory are real: every step runs the "
    "whole model (every weight product, the K/V appends, selection and attention). The context "
    "is not prefilled (128K tokens through 8B would take hours on this CPU): its K/V are put "
    "into the cache through `kvsift_model_sequence_append_kv`, keys of bench/key_maker.hpp (a "
    "mixture of topic directions per page, outlier channels, RoPE at theta 500000) and random "
    "values, and the first decode step follows them.")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib() -> float:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def time_report(path: str) -> dict[str, str]:
    """/usr/bin/time -v's "key: value" lines."""
    out = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                key, sep, value = line.strip().rpartition(": ")
                if sep:
                    out[key] = value
    return out


def contexts_in(raw: str) -> list[int]:
    found = (re.fullmatch(r"rows_(\d+)\.jsonl", name) for name in os.listdir(raw))
    return sorted(int(m.group(1)) for m in found if m)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--raw", required=True, help="the folder cpu_scale.sh wrote")
    p.add_argument("--model", required=True, help="the GGUF file the rows ran")
    p.add_argument("--shape", required=True, help="its make_model.py shape")
    p.add_argument("--source", default="unknown", help="the kvsift source version that ran")
    args = p.parse_args()

    contexts = contexts_in(args.raw)
    rows = []
    for context in contexts:
        with open(os.path.join(args.raw, f"rows_{context}.jsonl"), encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    if not rows:
        print(f"cpu_scale_table.py: no rows in {args.raw}", file=sys.stderr)
        return 1

    first = rows[0]
    print("# Decode at long contexts on the CPU\n")
    print(f"{NOTE}\n")
    print(f"- Model: `{os.path.basename(args.model)}`, shape `{args.shape}`; weights "
          f"`{first['weights']}`, KV cache `{first['kv_dtype']}`, batch {first['batch']}, "
          f"{first['steps']} timed steps a row.")
    print(f"- Machine: {cpu_name()}, {os.cpu_count()} CPUs, {memory_gib():.0f} GiB; run "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC from kvsift "
          f"`{args.source}`.\n")
    print("Per row: tokens/s = 1 / median step; the step's split into weights (the step minus "
          "selection and attention: products, norms, appends), attention and selection, medians "
          "of the timed steps; memory after the last step: VmRSS and VmHWM of the process, the "
          "KV pages held and the selector's summaries and indexes.\n")
    print("| context | selector | budget | tok/s | step ms (min, max) | weights ms | attention ms "
          "| selection ms | KV GB | selector MB | VmRSS GB | VmHWM GB | fill s |")
    print("|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["context"], r["selector"] != "dense", r["selector"],
                                         r["budget"])):
        budget = "-" if r["selector"] == "dense" else f"{r['budget']:g}"
        print(f"| {r['context']} | {r['selector']} | {budget} | {r['tok_s']:.2f} "
              f"| {r['step_ms']:.0f} ({r['step_ms_min']:.0f}, {r['step_ms_max']:.0f}) "
              f"| {r['weights_ms']:.0f} | {r['attend_us'] / 1e3:.1f} | {r['select_us'] / 1e3:.1f} "
              f"| {r['kv_bytes_held'] / 1e9:.2f} | {r['selector_bytes'] / 1e6:.1f} "
              f"| {r['vm_rss_bytes'] / 1e9:.2f} | {r['vm_hwm_bytes'] / 1e9:.2f} "
              f"| {r['fill_s']:.0f} |")

    print("\nEach context ran as one process under `/usr/bin/time -v`:\n")
    print("| context | exit status | peak resident GB (time -v) | wall time | command |")
    print("|---:|---:|---:|---|---|")
    for context in contexts:
        t = time_report(os.path.join(args.raw, f"time_{context}.txt"))
        peak_kb = t.get("Maximum resident set size (kbytes)")
        peak = f"{int(peak_kb) * 1024 / 1e9:.2f}" if peak_kb else "-"
        wall = t.get("Elapsed (wall clock) time (h:mm:ss or m:ss)", "-")
        command_path = os.path.join(args.raw, f"command_{context}.txt")
        command = open(command_path, encoding="utf-8").read().strip() if os.path.exists(
            command_path) else "-"
        print(f"| {context} | {t.get('Exit status', '-')} | {peak} | {wall} | `{command}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
