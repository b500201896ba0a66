#!/usr/bin/env python3
"""Formats kvsift-bench-ggml's JSON (bench/ggml/bench_ggml.cpp) as markdown tables.

    tools/peer/ggml_table.py RUN.json [RUN.json ...] --json-out ALL.json --md-out TABLE.md \
        --cpu "$(lscpu | sed -n 's/^Model name: *//p')" --command 'the command that ran'

Several runs (another thread count or OpenMP setting, or the 128K attention case run alone on a
quieter machine) go into one document, a section per run in the order given. Times are medians
over the samples with (min-max); a ratio is the ratio of the medians, with the range of the
per-round ratios in brackets (the variants of one round ran back to back, so each round's ratio
saw the same machine).
Standard library only.
"""

import argparse
import json
import sys


def per_round_ratios(timings, a, b):
    xs, ys = timings[a]["samples_ms"], timings[b]["samples_ms"]
    return [x / y for x, y in zip(xs, ys)]


def fmt_ms(t):
    return f"{t['median_ms']:.3g} ({t['min_ms']:.3g}-{t['max_ms']:.3g})"


def fmt_ratio(timings, a, b):
    r = timings[a]["median_ms"] / timings[b]["median_ms"]
    rounds = per_round_ratios(timings, a, b)
    return f"{r:.2f}x [{min(rounds):.2f}-{max(rounds):.2f}]"


def attention_table(cases):
    out = [
        "| context | ggml FA, llama.cpp layout | ggml FA, head-major | kvsift dense "
        "| kvsift LOCKS 2% | kvsift LOCKS 5% | FA llama / dense | FA head-major / dense "
        "| FA llama / LOCKS 2% | FA llama / LOCKS 5% | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        t = c["timings"]
        worst = max(v["worst_error_over_tolerance"] for v in c["checks"].values())
        out.append(
            f"| {c['context'] // 1024}K | {fmt_ms(t['ggml_fa_llama'])} | "
            f"{fmt_ms(t['ggml_fa_heads'])} | {fmt_ms(t['kvsift_dense'])} | "
            f"{fmt_ms(t['kvsift_locks_2'])} | {fmt_ms(t['kvsift_locks_5'])} | "
            f"{fmt_ratio(t, 'ggml_fa_llama', 'kvsift_dense')} | "
            f"{fmt_ratio(t, 'ggml_fa_heads', 'kvsift_dense')} | "
            f"{fmt_ratio(t, 'ggml_fa_llama', 'kvsift_locks_2')} | "
            f"{fmt_ratio(t, 'ggml_fa_llama', 'kvsift_locks_5')} | {worst:.2f} |"
        )
    return out


def matvec_table(cases):
    out = [
        "| format | projection | K -> N | weights MB | ggml_mul_mat | ggml_mul_mat, repacked "
        "| kvsift matvec_quant | ggml / kvsift | ggml repacked / kvsift "
        "| GB/s ggml, repacked, kvsift | kvsift as stored / kvsift | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        t = c["timings"]
        g = c["weight_GBps"]
        repacked = "ggml_mul_mat_repacked" in t
        rate = lambda name: f"{g[name]:.1f}" if name in g else "-"  # noqa: E731
        out.append(
            f"| {c['format']} | {c['projection']} | {c['K']} -> {c['N']} | "
            f"{c['weight_MB']:.1f} | {fmt_ms(t['ggml_mul_mat'])} | "
            + (fmt_ms(t["ggml_mul_mat_repacked"]) if repacked else "-")
            + f" | {fmt_ms(t['kvsift_matvec_quant'])} | "
            f"{fmt_ratio(t, 'ggml_mul_mat', 'kvsift_matvec_quant')} | "
            + (fmt_ratio(t, "ggml_mul_mat_repacked", "kvsift_matvec_quant") if repacked else "-")
            + f" | {rate('ggml_mul_mat')}, {rate('ggml_mul_mat_repacked')}, "
            f"{rate('kvsift_matvec_quant')} | "
            + (fmt_ratio(t, "kvsift_matvec_quant_stored", "kvsift_matvec_quant")
               if "kvsift_matvec_quant_stored" in t else "-")
            + f" | {c['checks']['worst_error_over_tolerance']:.2f} |"
        )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+",
                    help="kvsift-bench-ggml JSON files, or a document of this script to extend")
    ap.add_argument("--json-out", required=True)
    ap.add_argument("--md-out", required=True)
    ap.add_argument("--cpu", default="unknown")
    ap.add_argument("--command", action="append", default=[], help="a command that ran (repeat)")
    args = ap.parse_args()

    runs, commands = [], []
    for path in args.runs:
        with open(path) as f:
            loaded = json.load(f)
        if "runs" in loaded:  # a document this script wrote: extend it
            for run in loaded["runs"]:  # documents before runs named their CPU: the document's
                run.setdefault("cpu", loaded.get("cpu", "unknown"))
            runs += loaded["runs"]
            commands += loaded.get("commands", [])
        else:
            loaded.setdefault("cpu", args.cpu)
            runs.append(loaded)
    commands += args.command
    doc = {"commands": commands, "runs": runs}
    with open(args.json_out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")

    lines = [
        "# kvsift beside ggml's CPU kernels",
        "",
        "Written by `tools/peer/ggml_table.py` from `ggml-side-by-side.json` "
        "(`scripts/bench_vs_ggml.sh`; what is measured: `bench/ggml/bench_ggml.cpp`).",
        "",
        "Commands, in the order run (each run names its CPU):",
        "",
    ] + [f"{i + 1}. `{c}`" for i, c in enumerate(commands)]
    for i, run in enumerate(runs):
        attention = [c for c in run["cases"] if c["op"] == "attention"]
        matvec = [c for c in run["cases"] if c["op"] == "matvec"]
        env = run.get("openmp_environment") or {}
        lines += [
            "",
            f"## Run {i + 1}: {run['threads']} thread(s) per library"
            + (", " + ", ".join(f"{k}={v}" for k, v in env.items()) if env else ""),
            "",
            f"- CPU: {run['cpu']}",
            f"- samples per variant: {run['reps']}, each at least {run['min_sample_ms']} ms of "
            "back-to-back calls, the variants in turns",
            f"- ggml {run['ggml_version']} ({run['ggml_commit']}), CPU features "
            + ", ".join(k for k, v in run["ggml_cpu"].items() if v)
            + f"; kvsift {run['kvsift_version']}",
            f"- load average (1, 5, 15 min) at start / end: {run['load_average_start']} / "
            f"{run['load_average_end']}",
        ]
        if attention:
            lines += [
                "",
                "Decode attention, Llama-3.1-8B layer (32 query heads, 8 KV heads, d = 128, f16 "
                "K/V, one query, batch 1). Milliseconds per call, median (min-max); ratios of "
                "medians [range of per-round ratios]; check: the largest error over its "
                "tolerance (must be <= 1).",
                "",
            ] + attention_table(attention)
        if matvec:
            lines += [
                "",
                "Quantized matrix-vector products at Llama-3.1-8B shapes, weights from DRAM. "
                "Milliseconds per product, median (min-max); GB/s of weights at the median. "
                "Repacked: the weights in ggml's CPU_REPACK buffer type, as llama.cpp loads "
                "them by default (on x86 it interleaves Q4_0 rows for its own kernels; Q8_0 it "
                "leaves alone).",
                "",
            ] + matvec_table(matvec)
    with open(args.md_out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
