#!/usr/bin/env python3
"""Speed comparison on SmolLM2-135M-Instruct (GGUF Q4_1): prefill and decode tokens/s.

One JSON object per line on stdout, one line per (implementation, case):

    {"impl": "llama.cpp", "case": "prefill", "ctx": 2048, "n_tokens": 2048, "threads": 2,
     "reps": 3, "tok_s_median": ..., "tok_s_min": ..., "tok_s_max": ..., "samples_tok_s": [...], ...}

Cases (the same token ids go to every implementation):
  prefill  ctx=C: evaluate a C-token prompt from an empty cache; tok/s = C / time.
  decode   ctx=C: evaluate a (C - n_decode)-token prompt (not timed), then generate n_decode tokens
           greedily one at a time; tok/s = n_decode / time. The last step attends to C positions, so
           the run stays within the model's 8192 trained positions.

Implementations are functions with the signature  bench_X(case, tokens, args) -> list of tok/s
samples (one per repetition). bench_llamacpp is built in. bench_command runs any external runner (for
kvsift, once it exists) given with --cmd; the protocol is in README.md ("bench: external runner").

    tools/peer/.venv/bin/python tools/peer/bench.py [--threads 2] [--reps 3] [--impl llama.cpp]
    tools/peer/.venv/bin/python tools/peer/bench.py --impl cmd --cmd 'build/kvsift_bench ...'
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

TEXT_FILES = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GFDL-1.3",
              "/usr/share/common-licenses/Apache-2.0"]

# (case, ctx): prefill at 2K and 8K prompt tokens, decode at 1K and 8K context.
DEFAULT_CASES = [("prefill", 2048), ("prefill", 8192), ("decode", 1024), ("decode", 8192)]


def find_model():
    script = os.path.join(REPO, "scripts", "fetch_model.sh")
    return subprocess.run(["bash", script], check=True, capture_output=True, text=True).stdout.strip()


def prose_text():
    parts = [open(p, encoding="utf-8", errors="replace").read() for p in TEXT_FILES if os.path.exists(p)]
    if not parts:
        sys.path.insert(0, HERE)
        from make_fixture import PROSE  # fallback: the fixture's prose paragraph
        parts = [PROSE]
    return "\n\n".join(parts)


def prompt_tokens(tokenize, n):
    """Exactly n token ids of prose (no BOS): the text files, repeated as needed, then truncated."""
    text = prose_text()
    ids = tokenize(text)
    while len(ids) < n:
        ids = ids + tokenize("\n\n" + text)
    return ids[:n]


def summary(impl, case, ctx, n_tokens, samples, args, extra=None):
    line = {
        "impl": impl,
        "case": case,
        "ctx": ctx,
        "n_tokens": n_tokens,  # tokens timed: the prompt for prefill, the generated ones for decode
        "threads": args.threads,
        "reps": len(samples),
        "tok_s_median": round(statistics.median(samples), 2),
        "tok_s_min": round(min(samples), 2),
        "tok_s_max": round(max(samples), 2),
        "samples_tok_s": [round(s, 2) for s in samples],
    }
    line.update(extra or {})
    return line


# ----------------------------------------------------------------------------------------- llama.cpp

class LlamaCppSide:
    """llama.cpp through llama-cpp-python, loaded once and reused for every case."""

    def __init__(self, args):
        import numpy as np
        import llama_cpp
        self.np = np
        self.llama_cpp = llama_cpp
        self.n_ctx = max(c for _, c in args.cases)
        self.llm = llama_cpp.Llama(
            model_path=args.model,
            n_ctx=self.n_ctx,
            n_batch=args.n_batch,
            n_ubatch=args.n_ubatch,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            logits_all=False,
            flash_attn=args.flash_attn,
            type_k=llama_cpp.GGML_TYPE_F16,
            type_v=llama_cpp.GGML_TYPE_F16,
            seed=1234,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()
        self.info = {
            "version": f"llama-cpp-python {llama_cpp.__version__}",
            "n_batch": args.n_batch,
            "n_ubatch": args.n_ubatch,
            "flash_attn": args.flash_attn,
            "kv_type": "f16",
        }
        # warm-up: page in the mmap'd weights, let the thread pool start
        self.llm.reset()
        self.llm.eval(self.tokenize("Warm-up run.")[:8])

    def tokenize(self, text):
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def argmax_last(self):
        logits = self.np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))
        return int(self.np.argmax(logits))

    def prefill(self, ids):
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0

    def decode(self, ids, n_decode, reps):
        """Prefill once (not timed), then per repetition drop the generated tokens from the KV cache
        (eval() trims the cache to n_tokens) and generate n_decode tokens again."""
        self.llm.reset()
        self.llm.eval(ids)
        first = self.argmax_last()
        times = []
        for _ in range(reps):
            self.llm.n_tokens = len(ids)
            tok = first
            t0 = time.perf_counter()
            for _ in range(n_decode):
                self.llm.eval([tok])
                tok = self.argmax_last()
            times.append(time.perf_counter() - t0)
        return times


_llamacpp = None


def bench_llamacpp(case, tokens, args):
    global _llamacpp
    if _llamacpp is None:
        _llamacpp = LlamaCppSide(args)
    kind, ctx = case
    if kind == "prefill":
        samples = [len(tokens) / _llamacpp.prefill(tokens) for _ in range(args.reps)]
    else:
        samples = [args.n_decode / t for t in _llamacpp.decode(tokens, args.n_decode, args.reps)]
    return samples, _llamacpp.info


# ------------------------------------------------------------------------------- external command

RESERVED = {"tok_s", "impl", "case", "ctx", "n_tokens", "threads", "reps", "tok_s_median", "tok_s_min",
            "tok_s_max", "samples_tok_s", "n_prompt"}


def bench_command(case, tokens, args):
    """Runs args.cmd once per repetition. Placeholders substituted in the command line:
    {model} {threads} {case} {ctx} {n_decode} {tokens_file}. {tokens_file} is a JSON file holding
    the prompt token ids (a list of ints). The command prints a JSON object on its last stdout line
    with at least "tok_s" (tokens/s of the timed part) and optionally "version"."""
    kind, ctx = case
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(tokens, f)
        tokens_file = f.name
    try:
        cmd = args.cmd
        for key, val in {"model": shlex.quote(args.model), "threads": args.threads, "case": kind,
                         "ctx": ctx, "n_decode": args.n_decode,
                         "tokens_file": shlex.quote(tokens_file)}.items():
            cmd = cmd.replace("{" + key + "}", str(val))
        samples, info = [], {}
        for _ in range(args.reps):
            res = subprocess.run(cmd, shell=True, check=True, capture_output=True, text=True)
            out = json.loads(res.stdout.strip().splitlines()[-1])
            samples.append(float(out["tok_s"]))
            info = {k: v for k, v in out.items() if k not in RESERVED}
        info["cmd"] = args.cmd
        return samples, info
    finally:
        os.unlink(tokens_file)


IMPLS = {"llama.cpp": bench_llamacpp, "cmd": bench_command}


def parse_cases(spec):
    cases = []
    for item in spec.split(","):
        kind, ctx = item.split(":")
        assert kind in ("prefill", "decode"), kind
        cases.append((kind, int(ctx)))
    return cases


def main():
    ap = argparse.ArgumentParser(description="prefill/decode tokens/s, JSON lines on stdout")
    ap.add_argument("--model", default=None, help="GGUF path (default: scripts/fetch_model.sh)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n-decode", type=int, default=64)
    ap.add_argument("--cases", default=",".join(f"{k}:{c}" for k, c in DEFAULT_CASES),
                    help="comma list of prefill:CTX / decode:CTX (default %(default)s)")
    ap.add_argument("--impl", action="append", choices=sorted(IMPLS),
                    help="implementation(s) to run; repeatable (default llama.cpp)")
    ap.add_argument("--cmd", default=None, help="external runner command line for --impl cmd")
    ap.add_argument("--impl-name", default="cmd", help='"impl" field for --impl cmd lines (e.g. kvsift)')
    ap.add_argument("--flash-attn", action="store_true",
                    help="llama.cpp: flash attention on (default off, as in the fixture)")
    ap.add_argument("--n-batch", type=int, default=2048, help="llama.cpp logical batch (llama-bench default)")
    ap.add_argument("--n-ubatch", type=int, default=512, help="llama.cpp physical batch (llama-bench default)")
    args = ap.parse_args()
    args.cases = parse_cases(args.cases)
    args.impl = args.impl or ["llama.cpp"]
    if "cmd" in args.impl and not args.cmd:
        ap.error("--impl cmd needs --cmd")
    args.model = args.model or find_model()

    # Prompt ids come from llama.cpp's tokenizer (a small context, cheap), so every side gets the same ids.
    import llama_cpp
    vocab = llama_cpp.Llama(model_path=args.model, n_ctx=64, n_threads=1, verbose=False)
    tokenize = lambda s: vocab.tokenize(s.encode("utf-8"), add_bos=False, special=False)
    longest = prompt_tokens(tokenize, max(c for _, c in args.cases))

    for impl in args.impl:
        for case in args.cases:
            kind, ctx = case
            n_prompt = ctx if kind == "prefill" else ctx - args.n_decode
            load_before = os.getloadavg()[0]
            samples, info = IMPLS[impl](case, longest[:n_prompt], args)
            load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            name = args.impl_name if impl == "cmd" else impl
            n_timed = n_prompt if kind == "prefill" else args.n_decode
            # 1-minute load average before/after: the machine's cores may be shared with others
            extra = dict(info, n_prompt=n_prompt, loadavg_1m=load)
            print(json.dumps(summary(name, kind, ctx, n_timed, samples, args, extra)), flush=True)


if __name__ == "__main__":
    main()
