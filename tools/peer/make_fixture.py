#!/usr/bin/env python3
"""Writes tests/data/smollm2_llamacpp.json: reference tokenizations, next-token logits and greedy
continuations of SmolLM2-135M-Instruct (GGUF Q4_1) computed by llama.cpp (llama-cpp-python).

kvsift's tokenizer and forward pass are checked against this file. Run with the venv made by
tools/peer/setup.sh:

    tools/peer/.venv/bin/python tools/peer/make_fixture.py [--model PATH] [--out PATH]
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import llama_cpp

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_OUT = os.path.join(REPO, "tests", "data", "smollm2_llamacpp.json")

N_CTX = 2048
N_THREADS = 2
N_BATCH = 512
N_UBATCH = 512
SEED = 1234
TOP_K_LOGITS = 50
GREEDY_TOKENS = 32
EOS_ID = 2  # <|im_end|>

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT_TEMPLATE = (
    "<|im_start|>system\n{system}<|im_end|>\n"
    "<|im_start|>user\n{q}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def chat(q):
    return CHAT_TEMPLATE.format(system=SYSTEM, q=q)


# (text, also_with_special): every string is tokenized with special=False; strings that contain
# special tokens written as text are tokenized with special=True as well.
TOKENIZE_CASES = [
    ("Hello, world!", False),
    (" leading space and trailing spaces   ", False),
    ("", False),
    ("Café crème brûlée, naïve façade, Ångström, Ærø", False),
    ("Größenordnung straße ĳ Œuvre", False),
    ("日本語のテキストと中文字符", False),
    ("안녕하세요 세계", False),
    ("Emoji: 😀👍🏽🚀 and family 👨‍👩‍👧", False),
    ("1234567", False),
    ("3.14159 and -0.001e-5", False),
    ("In the year 2024, 1,000,000 people paid $12.50 each.", False),
    ("Arabic-Indic digits ٣٤٥ and fullwidth １２３", False),
    ("a  b   c    d", False),
    ("tab\tseparated\t\tvalues", False),
    ("line one\nline two\n\n\nline five\r\nwindows", False),
    ("trailing newline and spaces \n  \n", False),
    ("def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n    return a + b\n", False),
    ("#include <vector>\nint main() {\n\tstd::vector<int> v{1, 2, 3};\n\treturn v.size() > 2 ? 0 : 1;\n}\n", False),
    ("I don't know, I'll see; you're right, it's theirs, we've won, they'd go.", False),
    ("DON'T SHOUT. camelCaseIdentifier snake_case_name HTTPServerError iPhone", False),
    ("The URL is https://example.com/path?q=1&r=2#frag; email me@example.org", False),
    ("<|im_start|>user\nHi<|im_end|>\n", True),
    ("text<|endoftext|>more text", True),
    ("<|im_start|><|im_end|> <|im_start|>", True),
    ("<|im_start|>system\n" + SYSTEM + "<|im_end|>\n", True),
]

PROSE = (
    "The lighthouse keeper woke before dawn, as he had every morning for thirty years. He climbed "
    "the spiral stairs slowly, counting the steps out of habit rather than necessity, and paused at "
    "the small window halfway up to look at the sea. It was calm today, a sheet of grey glass "
    "stretching toward a horizon that had not yet decided where the sky began. At the top he "
    "cleaned the great lens with a soft cloth, checked the oil, and wrote the date in the logbook "
    "in his careful, slanting hand. Nothing much ever happened on the island, and he liked it that "
    "way. Ships passed in the distance, gulls argued over scraps on the rocks below, and once a "
    "year a supply boat brought flour, coffee, letters and newspapers that were already weeks old. "
    "He read every page of them anyway, slowly, in the evenings, while the beam turned above his "
    "head and swept its long white arm across the water. Some nights he wondered whether anyone "
    "out there still looked for the light, or whether the satellites and radios had made him a "
    "relic, a man keeping a promise that nobody remembered asking him to make."
)

CODE = (
    "import math\n"
    "\n"
    "def is_prime(n: int) -> bool:\n"
    "    \"\"\"Return True if n is a prime number.\"\"\"\n"
    "    if n < 2:\n"
    "        return False\n"
    "    for d in range(2, int(math.isqrt(n)) + 1):\n"
    "        if n % d == 0:\n"
    "            return False\n"
    "    return True\n"
    "\n"
    "\n"
    "primes = [p for p in range(100) if is_prime(p)]\n"
    "print(len(primes), primes[:10])\n"
)

LOGIT_PROMPTS = [
    ("chat", chat("Explain in two sentences why the sky is blue.")),
    ("prose", PROSE),
    ("code", CODE),
]

GREEDY_PROMPTS = [
    # Chosen so that the 32-token greedy paths have no near-ties in their first steps (see
    # top1_top2_margin). The bare "What is the capital of France?" is a near-tie on this Q4_1 file:
    # its first token is "L" (24.740) vs "The" (24.651) and the answer wanders off in French.
    ("capital", chat("What is the capital of France? Tell me about it.")),
    ("story", chat("Write a short story about a brave little mouse.")),
    ("math", chat("A farmer has 17 sheep and buys 8 more, then sells 5. How many sheep does he have? "
                  "Explain step by step.")),
    ("list", chat("Name five countries in Europe and their capitals.")),
]


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def find_model():
    script = os.path.join(REPO, "scripts", "fetch_model.sh")
    return subprocess.run(["bash", script], check=True, capture_output=True, text=True).stdout.strip()


def load(model_path):
    return llama_cpp.Llama(
        model_path=model_path,
        n_ctx=N_CTX,
        n_batch=N_BATCH,
        n_ubatch=N_UBATCH,
        n_threads=N_THREADS,
        n_threads_batch=N_THREADS,
        logits_all=True,
        flash_attn=False,
        type_k=llama_cpp.GGML_TYPE_F16,
        type_v=llama_cpp.GGML_TYPE_F16,
        seed=SEED,
        verbose=False,
    )


def decode_text(llm, ids):
    return llm.detokenize(ids).decode("utf-8", errors="replace")


def rounded(x, nd=4):
    return float(round(float(x), nd))


def logsumexp(row):
    m = float(np.max(row))
    return m + float(np.log(np.sum(np.exp(row.astype(np.float64) - m))))


def to_json(v, ind=0):
    """Indented JSON with lists of numbers (and lists of [id, logit] pairs) kept on one line."""
    flat = lambda x: not isinstance(x, (dict, list)) or (
        isinstance(x, list) and all(not isinstance(y, (dict, list)) for y in x))
    if isinstance(v, dict) and v:
        pad = " " * (ind + 1)
        items = [f"{pad}{json.dumps(k)}: {to_json(x, ind + 1)}" for k, x in v.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * ind + "}"
    if isinstance(v, list) and v and not all(flat(x) for x in v):
        pad = " " * (ind + 1)
        return "[\n" + ",\n".join(pad + to_json(x, ind + 1) for x in v) + "\n" + " " * ind + "]"
    return json.dumps(v, ensure_ascii=False, separators=(",", ":") if isinstance(v, list) else None)


def tokenize_section(llm):
    out = []
    for text, with_special in TOKENIZE_CASES:
        for special in ([False, True] if with_special else [False]):
            ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
            out.append({"text": text, "special": special, "ids": ids})
    return out


def pick_positions(n):
    """~5 positions spread over the prompt, always including the last one (n - 1)."""
    cand = [0, n // 4, n // 2, (3 * n) // 4, n - 1]
    return sorted(set(p for p in cand if 0 <= p < n))


def logits_section(llm):
    out = []
    for name, prompt in LOGIT_PROMPTS:
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[: len(ids)], dtype=np.float32)
        positions = []
        for p in pick_positions(len(ids)):
            row = scores[p]
            top = np.argsort(-row, kind="stable")[:TOP_K_LOGITS]
            positions.append({
                "pos": p,  # logits after consuming ids[0..pos], i.e. predicting token pos + 1
                "logsumexp": rounded(logsumexp(row)),
                "top": [[int(t), rounded(row[t])] for t in top],
            })
        out.append({"name": name, "prompt": prompt, "ids": ids, "positions": positions})
    return out


def greedy_section(llm):
    out = []
    for name, prompt in GREEDY_PROMPTS:
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        gen, margins = [], []
        stopped = False
        for _ in range(GREEDY_TOKENS):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            top2 = np.argsort(-row, kind="stable")[:2]
            tok = int(top2[0])
            gen.append(tok)
            margins.append(rounded(row[top2[0]] - row[top2[1]]))
            if tok == EOS_ID:
                stopped = True
                break
            llm.eval([tok])
        out.append({
            "name": name,
            "prompt": prompt,
            "prompt_ids": ids,
            "generated_ids": gen,
            "n_generated": len(gen),
            "stopped_at_eos": stopped,
            # logit(top-1) - logit(top-2) at each step: a near-tie explains a divergence
            "top1_top2_margin": margins,
            "text": decode_text(llm, [t for t in gen if t != EOS_ID]),
        })
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: scripts/fetch_model.sh)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()

    model_path = args.model or find_model()
    t0 = time.time()
    llm = load(model_path)

    fixture = {
        "generator": "tools/peer/make_fixture.py",
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp_commit": "ggml-org/llama.cpp@0c1e57098 (vendored by llama-cpp-python 0.3.36)",
        "model_file": os.path.basename(model_path),
        "model_sha256": sha256_file(model_path),
        "n_vocab": llm.n_vocab(),
        "n_ctx_train": llm._model.n_ctx_train(),
        "special_ids": {"bos": llm.token_bos(), "eos": llm.token_eos(),
                        "im_start": 1, "im_end": 2, "endoftext": 0},
        "settings": {
            "n_threads": N_THREADS,
            "n_threads_batch": N_THREADS,
            "n_ctx": N_CTX,
            "n_batch": N_BATCH,
            "n_ubatch": N_UBATCH,
            "seed": SEED,
            "flash_attn": False,
            "kv_cache_type_k": "f16",
            "kv_cache_type_v": "f16",
            "add_bos": False,
            "prompt_eval": "whole prompt in one llm.eval call (batches of n_batch), logits_all=True",
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "numerics_notes": [
                "CPU matmuls quantize activations: Q4_1 weights x Q8_1 activations, "
                "Q8_0 token_embd/output x Q8_0 activations (ggml-cpu vec_dot_type)",
                "attention without flash attention: K and V cached as f16; KQ and KQV use f16 x f16 dot products",
                "ggml build: GGML_NATIVE=ON (-march=native) on an AVX-512 x86-64 CPU, OpenMP",
            ],
        },
        "chat_template": CHAT_TEMPLATE.replace("{system}", SYSTEM),
        "tokenize": tokenize_section(llm),
        "logits": logits_section(llm),
        "greedy": greedy_section(llm),
    }

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(to_json(fixture))
        f.write("\n")
    size = os.path.getsize(args.out)
    print(f"wrote {args.out} ({size} bytes) in {time.time() - t0:.1f} s", file=sys.stderr)
    for g in fixture["greedy"]:
        print(f"[{g['name']}] {g['n_generated']} tokens, eos={g['stopped_at_eos']}: {g['text']!r}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
