#!/usr/bin/env python3
"""The markdown table of scripts/cpu_scale.sh and scripts/gpu_scale.sh: kvsift-bench-decode's JSON
rows (rows_*.jsonl) and, where they exist, /usr/bin/time -v's report of each process
(time_<context>.txt) from one raw folder, printed on stdout. Rows run in offload mode (device not
"cpu") get the transfer columns. Standard library only."""

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
    "is not prefilled (a prefill of 128K tokens through 8B takes hours on a CPU, and of 512K "
    "about half an hour on an H200: docs/results/gpu-scale/raw/prefill.txt): its K/V are "
    "put into the cache through `kvsift_model_sequence_append_kv`, keys of bench/key_maker.hpp (a "
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
    found = (re.fullmatch(r"time_(\d+)\.txt", name) for name in os.listdir(raw))
    return sorted(int(m.group(1)) for m in found if m)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--raw", required=True, help="the folder cpu_scale.sh wrote")
    p.add_argument("--model", required=True, help="the GGUF file the rows ran")
    p.add_argument("--shape", required=True, help="its make_model.py shape")
    p.add_argument("--source", default="unknown", help="the kvsift source version that ran")
    p.add_argument("--title", default="Decode at long contexts on the CPU")
    p.add_argument("--machine", help="the machine that ran the rows (default: this one)")
    args = p.parse_args()

    rows = []
    for name in sorted(os.listdir(args.raw)):
        if re.fullmatch(r"rows_.*\.jsonl", name):
            with open(os.path.join(args.raw, name), encoding="utf-8") as f:
                rows += [json.loads(line) for line in f if line.strip()]
    if not rows:
        print(f"scale_table.py: no rows in {args.raw}", file=sys.stderr)
        return 1
    offload = any(r["device"] != "cpu" for r in rows)

    first = rows[0]
    print(f"# {args.title}\n")
    print(f"{NOTE}\n")
    print(f"- Model: `{os.path.basename(args.model)}`, shape `{args.shape}`; weights "
          f"`{first['weights']}`, KV cache `{first['kv_dtype']}`, batch "
          f"{', '.join(str(b) for b in sorted({r['batch'] for r in rows}))}, "
          f"{' or '.join(str(n) for n in sorted({r['steps'] for r in rows}))} timed steps a row.")
    machine = args.machine or f"{cpu_name()}, {os.cpu_count()} CPUs, {memory_gib():.0f} GiB"
    print(f"- Machine: {machine}; table written "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC from kvsift "
          f"`{args.source}`.\n")
    print("Per row: tokens/s = 1 / median step; the step's split into weights (the step minus "
          "selection and attention: products, norms, appends), attention and selection, medians "
          "of the timed steps; memory after the last step: VmRSS and VmHWM of the process, the "
          "KV pages held and the selector's summaries and indexes.")
    transfer_head, transfer_rule = "", ""
    if offload:
        print("\nOffload rows: selection on the CPU, or on the device where the selector says "
              "(device); transfer ms is the device's interval for the page moves (the CPU's "
              "planning of them included), plan ms that planning alone (rows written before it "
              "was recorded: -; since the moves go in pieces, most of it runs while the device "
              "gathers the previous piece), MB/step the bytes sent host to device, hit the "
              "device page cache's hit rate, cache the (page, KV head) slots it holds per layer "
              "(0: a copy of the whole KV cache, every page resident in device memory: the HBM "
              "baseline), vs HBM the step's time over the dense row with cache 0 at the same "
              "context and batch, device GB the device memory in use after the last step (the "
              "driver's count for the whole device: weights, caches, selector data, workspaces, "
              "the CUDA context; rows written before it was recorded: -).")
        transfer_head = " transfer ms | plan ms | MB/step | hit | cache | vs HBM | device GB |"
        transfer_rule = "---:|---:|---:|---:|---:|---:|---:|"
    hbm = {(r["context"], r["batch"]): r["step_ms"] for r in rows
           if r["selector"] == "dense" and r.get("device_cache_pages", 0) == 0}
    print("\n| context | batch | selector | budget | tok/s | step ms (min, max) | weights ms "
          f"| attention ms | selection ms |{transfer_head} KV GB | selector MB | VmRSS GB "
          "| VmHWM GB | fill s |")
    print(f"|---:|---:|---|---:|---:|---|---:|---:|---:|{transfer_rule}---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["context"], r["batch"], r["selector"] != "dense",
                                         r["selector"], r["budget"], r.get("select_on", "cpu"))):
        budget = "-" if r["selector"] == "dense" else f"{r['budget']:g}"
        selector = r["selector"]
        if r.get("select_on") == "device" and selector != "dense":
            selector += " (device)"
        transfer = ""
        if offload:
            base = hbm.get((r["context"], r["batch"]))
            ratio = f"{r['step_ms'] / base:.2f}" if base else "-"
            hit = "-" if r.get("hit_rate") is None else f"{r['hit_rate']:.3f}"
            plan = "-" if r.get("plan_us") is None else f"{r['plan_us'] / 1e3:.1f}"
            used = r.get("device_used_bytes")
            device_gb = "-" if not used else f"{used / 1e9:.1f}"
            transfer = (f" {r['transfer_us'] / 1e3:.1f} | {plan} | {r['h2d_MB']:.1f} | {hit} "
                        f"| {r.get('device_cache_pages', 0)} | {ratio} | {device_gb} |")
        print(f"| {r['context']} | {r['batch']} | {selector} | {budget} | {r['tok_s']:.2f} "
              f"| {r['step_ms']:.1f} ({r['step_ms_min']:.1f}, {r['step_ms_max']:.1f}) "
              f"| {r['weights_ms']:.1f} | {r['attend_us'] / 1e3:.1f} | {r['select_us'] / 1e3:.1f} "
              f"|{transfer} {r['kv_bytes_held'] / 1e9:.2f} | {r['selector_bytes'] / 1e6:.1f} "
              f"| {r['vm_rss_bytes'] / 1e9:.2f} | {r['vm_hwm_bytes'] / 1e9:.2f} "
              f"| {r['fill_s']:.0f} |")
    contexts = contexts_in(args.raw)
    if not contexts:
        return 0

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
