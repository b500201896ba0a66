#!/usr/bin/env python3
"""Torch SDPA decode attention with the KV cache resident in HBM: column (a) torch of
scripts/gpu_bench.sh's table, beside bench/bench_offload.cpp's (a) ours.

One Llama-3.1-8B layer: q [B, 32, 1, 128] against K, V [B, 8, T, 128] bf16. Two forms, both torch's
scaled_dot_product_attention, each timed with CUDA events per call (median, min, max over --reps
after a warm-up):
  gqa      q [B, 32, 1, 128], enable_gqa=True (the math backend is excluded: it would repeat K and V
           four times, 128 GiB at 1M x 8; where no fused backend takes the call it is reported as
           failed, not run)
  grouped  the G = 4 query heads of a KV head as 4 query rows, q [B, 8, 4, 128] against K, V
           unchanged: the same decode attention (no mask: every query row sees every key), which
           every fused backend takes
The faster form is the baseline; both are in the CSV (--csv; one line per (T, B, form), flushed).
K and V are filled in place (uniform noise) so that no fp32 temporary doubles the memory.
"""
import argparse
import contextlib
import csv
import sys
import time

KV_HEADS, GROUP, HEAD_DIM = 8, 4, 128


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="32768,131072,524288,1048576")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--csv", default="")
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.replace(",", " ").split()]
    batches = [int(x) for x in args.batches.replace(",", " ").split()]
    start = time.time()

    def say(msg):
        print(f"[{time.time() - start:7.1f} s] {msg}", flush=True)

    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001 - any import failure means no baseline
        say(f"sdpa_baseline: torch is not importable ({e}): no torch baseline")
        return 0
    if not torch.cuda.is_available():
        say("sdpa_baseline: torch sees no CUDA device: no torch baseline")
        return 0
    say(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        fused = [b for b in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
                 if hasattr(SDPBackend, b)]

        def no_math():
            return sdpa_kernel([getattr(SDPBackend, b) for b in fused])
    except ImportError:
        def no_math():
            return contextlib.nullcontext()

    out = open(args.csv, "w", newline="") if args.csv else None
    writer = csv.writer(out) if out else None
    if writer:
        writer.writerow(["context", "batch", "form", "status", "us", "min", "max", "tbps"])
        out.flush()

    rows = sorted(((t, b) for t in contexts for b in batches), key=lambda r: (r[0] * r[1], r[0]))
    dev = torch.device("cuda")
    for T, B in rows:
        k = v = None
        try:
            k = torch.empty(B, KV_HEADS, T, HEAD_DIM, dtype=torch.bfloat16, device=dev).uniform_(-1, 1)
            v = torch.empty_like(k).uniform_(-1, 1)
        except torch.cuda.OutOfMemoryError as e:
            say(f"T={T} B={B}: cannot allocate K and V ({e})")
            for form in ("gqa", "grouped"):
                if writer:
                    writer.writerow([T, B, form, "out of device memory", "", "", "", ""])
            k = v = None
            torch.cuda.empty_cache()
            continue
        kv_bytes = 2 * k.numel() * k.element_size()
        q_full = torch.empty(B, KV_HEADS * GROUP, 1, HEAD_DIM, dtype=torch.bfloat16,
                             device=dev).uniform_(-1, 1)
        forms = {
            "gqa": lambda: F.scaled_dot_product_attention(q_full, k, v, enable_gqa=True),
            # [B, 32, 1, d] -> [B, 8, 4, d]: query head h * G + g is row g of KV head h.
            "grouped": lambda: F.scaled_dot_product_attention(
                q_full.view(B, KV_HEADS, GROUP, HEAD_DIM), k, v),
        }
        for form, fn in forms.items():
            status, times = "ok", []
            try:
                with no_math():
                    for _ in range(args.warmup):
                        fn()
                    torch.cuda.synchronize()
                    events = [(torch.cuda.Event(enable_timing=True),
                               torch.cuda.Event(enable_timing=True)) for _ in range(args.reps)]
                    for a, b in events:
                        a.record()
                        fn()
                        b.record()
                    torch.cuda.synchronize()
                times = sorted(a.elapsed_time(b) * 1e3 for a, b in events)
            except Exception as e:  # noqa: BLE001 - report the form as failed, keep going
                status = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                torch.cuda.synchronize()
            if times:
                n = len(times)
                med = times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])
                tbps = kv_bytes / med * 1e-6
                say(f"T={T} B={B} {form}: {med:.1f} us ({times[0]:.1f}..{times[-1]:.1f}), "
                    f"{tbps:.2f} TB/s of K+V")
                row = [T, B, form, status, f"{med:.3f}", f"{times[0]:.3f}", f"{times[-1]:.3f}",
                       f"{tbps:.4f}"]
            else:
                say(f"T={T} B={B} {form}: {status}")
                row = [T, B, form, status, "", "", "", ""]
            if writer:
                writer.writerow(row)
                out.flush()
        del k, v, q_full, forms
        torch.cuda.empty_cache()
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
