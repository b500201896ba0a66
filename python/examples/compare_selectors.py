"""Mass recall of kvsift's selectors on a real model's decode queries.

Loads a Llama-family GGUF model in transformers, prefills a long prompt (kvsift-demo's document by
default), greedy-decodes --steps tokens and captures every layer's post-RoPE decode queries, keys
and values. Then, for each selector and budget, a kvsift.Cache holding those K/V selects for each
captured query (Cache.select), and the mass recall -- the share of the exact softmax mass that the
selected pages and tokens hold, exact attention computed in numpy float64 over the keys as kvsift
stores them (fp16) -- is averaged over query heads, layers and steps.

    python python/examples/compare_selectors.py --model "$(scripts/fetch_model.sh)"

Needs torch, transformers and gguf. The oracle ranks pages by each head's exact mass share,
averaged over the group (combine "share_avg"): the best a page selector can do on this measure at
its page count. S4R compresses keys before RoPE: its cache gets pre-RoPE keys, channels reordered
from transformers' half-split RoPE layout to the adjacent pairs kvsift rotates (queries likewise;
dot products are unchanged); its recall counts the tokens it chose, not its reconstruction error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvsift

PAGE_TOKENS = 16
SELECTORS = ("oracle", "quest", "locks", "locks_certified", "louver", "s4r")
PLANTED = "Editor's note: the lighthouse keeper on Gull Island keeps a grey cat named Marmalade."
QUESTION = ("According to the editor's note in the text above, what is the name of the lighthouse "
            "keeper's cat?")


DICTIONARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "apps",
                          "common", "devils_dictionary.txt")


def demo_document(path: str = DICTIONARY) -> str:
    """kvsift-demo's built-in document (apps/demo.cpp): The Devil's Dictionary, a fact planted."""
    with open(path, "rb") as f:
        text = f.read()
    doc = text[text.index(b"PREFACE"):][:20000]
    doc = doc[:doc.rindex(b"\n\n")]
    middle = doc.index(b"\n\n", len(doc) // 2)
    return (doc[:middle] + b"\n\n" + PLANTED.encode() + doc[middle:]).decode()


@torch.no_grad()
def capture(model, tokens: list[int], steps: int):
    """Prefill, then greedy steps; per layer: queries [steps, H, d] (the prefill's last query and
    each decode step's), post-RoPE keys, pre-RoPE keys and values [n, Hkv, d] float32."""
    queries: dict[int, list] = {}
    pre_rope: dict[int, list] = {}

    def record(module, query, key, value, mask, **kw):
        queries.setdefault(module.layer_idx, []).append(query[0, :, -1].float().cpu().numpy())
        return sdpa_attention_forward(module, query, key, value, mask, **kw)

    AttentionInterface.register("kvsift_capture", record)
    model.set_attn_implementation("kvsift_capture")
    hooks = [layer.self_attn.k_proj.register_forward_hook(
        lambda m, i, out, l=l: pre_rope.setdefault(l, []).append(out[0].float().cpu().numpy()))
        for l, layer in enumerate(model.model.layers)]
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([tokens], device=model.device)
    for _ in range(steps):
        logits = model(ids, past_key_values=cache, use_cache=True).logits
        ids = logits[:, -1:].argmax(-1)
    for h in hooks:
        h.remove()
    n_kv = model.config.num_key_value_heads
    n = len(tokens) + steps - 1  # the last step's own token is in the cache, the next one is not
    out = []
    for l, layer in enumerate(cache.layers):
        k = layer.keys[0, :, :n].transpose(0, 1).float().cpu().numpy()
        v = layer.values[0, :, :n].transpose(0, 1).float().cpu().numpy()
        kp = np.concatenate(pre_rope[l])[:n].reshape(n, n_kv, -1)
        out.append((np.stack(queries[l]), k, kp, v))
    return out


def exact_weights(q: np.ndarray, k: np.ndarray, group: int) -> np.ndarray:
    """Softmax of q.k / sqrt(d) in float64 over fp16-rounded keys: [H, n] for q [H, d]."""
    k16 = k.astype(np.float16).astype(np.float64)  # [n, Hkv, d]
    kh = np.repeat(k16.transpose(1, 0, 2), group, axis=0)  # [H, n, d]
    s = np.einsum("hnd,hd->hn", kh, q.astype(np.float64)) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(axis=1, keepdims=True))
    return w / w.sum(axis=1, keepdims=True)


def recall(weights: np.ndarray, chosen: kvsift.Selection, group: int, page_tokens: int):
    """(mean mass recall over query heads, tokens attended / context) for one layer and step."""
    n = weights.shape[1]
    shares, attended = [], 0
    for g in range(chosen.n_kv_heads):
        mask = np.zeros(n, dtype=bool)
        for p in chosen.pages(0, g):
            mask[p * page_tokens:(p + 1) * page_tokens] = True
        mask[chosen.tokens(0, g)] = True
        attended += mask.sum()
        shares += [weights[h, mask].sum() for h in range(g * group, (g + 1) * group)]
    return float(np.mean(shares)), attended / (n * chosen.n_kv_heads)


def to_gguf_pairs(x: np.ndarray) -> np.ndarray:
    """Channels from transformers' RoPE layout (i, i + d/2) to adjacent pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    return np.ascontiguousarray(x[..., np.arange(d).reshape(2, d // 2).T.reshape(-1)])


def evaluate(data, config, selector: str, budget: float, n_prompt: int, layers, weights):
    """Mean and minimum recall, and mean tokens attended share, of one selector and budget."""
    n_kv, n_heads = config.num_key_value_heads, config.num_attention_heads
    group, d = n_heads // n_kv, data[0][0].shape[-1]
    pre = selector == "s4r"
    cache = kvsift.Cache(n_layers=len(data), n_kv_heads=n_kv, group_size=group, head_dim=d,
                         page_tokens=PAGE_TOKENS,
                         key_form="pre_rope" if pre else "post_rope",
                         rope_theta=float(getattr(config, "rope_theta", None) or
                                          config.rope_parameters["rope_theta"]))
    with cache:
        cache.set_selector(selector=selector, budget=budget,
                           **({"combine": "share_avg"} if selector == "oracle" else {}))
        seq = cache.create_sequence()
        keys = [to_gguf_pairs(kp) if pre else k for _, k, kp, _ in data]
        for l in range(len(data)):
            cache.append(seq, l, keys[l][:n_prompt], data[l][3][:n_prompt])
        recalls, attended = [], []
        for s in range(data[0][0].shape[0]):
            for l in range(len(data)):
                if s > 0:
                    pos = n_prompt + s - 1
                    cache.append(seq, l, keys[l][pos:pos + 1], data[l][3][pos:pos + 1])
                q = data[l][0][s]
                chosen = cache.select(l, [seq], to_gguf_pairs(q)[None] if pre else q[None])
                if l in layers:
                    r, a = recall(weights[l][s], chosen, group, PAGE_TOKENS)
                    recalls.append(r)
                    attended.append(a)
    return float(np.mean(recalls)), float(np.min(recalls)), float(np.mean(attended))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("KVSIFT_MODEL"), help="a GGUF file")
    ap.add_argument("--text", help="a UTF-8 text file (default: kvsift-demo's document)")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="cut the prompt to N tokens")
    ap.add_argument("--steps", type=int, default=8, help="decode queries per layer")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.02, 0.05, 0.10])
    ap.add_argument("--selectors", nargs="+", default=list(SELECTORS), choices=SELECTORS)
    ap.add_argument("--layers", help="layers measured, e.g. 0,15,29 (default: all)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    if not a.model:
        ap.error("--model (or KVSIFT_MODEL) is needed")

    folder, name = os.path.split(os.path.abspath(a.model))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    text = open(a.text, encoding="utf-8").read() if a.text else demo_document()
    chat = [{"role": "user", "content": text + "\n\n" + QUESTION}]
    tokens = AutoTokenizer.from_pretrained(folder, gguf_file=name).apply_chat_template(
        chat, add_generation_prompt=True)["input_ids"]
    if a.prompt_tokens:
        tokens = tokens[:a.prompt_tokens]
    data = capture(model, tokens, a.steps)
    layers = (set(range(len(data))) if not a.layers else {int(x) for x in a.layers.split(",")})
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    weights = {l: [exact_weights(data[l][0][s], data[l][1][:len(tokens) + s], group)
                   for s in range(a.steps)] for l in layers}

    print(f"{len(tokens)} prompt tokens, {a.steps} decode steps, {len(layers)} of {len(data)} "
          f"layers; mass recall (mean over heads, layers, steps) against exact float64 softmax")
    print(f"{'selector':<16}{'budget':>7}{'recall':>9}{'min':>8}{'attended':>10}")
    results = []
    for sel in a.selectors:
        for b in a.budgets:
            mean, low, att = evaluate(data, model.config, sel, b, len(tokens), layers, weights)
            results.append({"selector": sel, "budget": b, "recall": mean, "min_recall": low,
                            "attended": att})
            print(f"{sel:<16}{b:>7.0%}{mean:>9.4f}{low:>8.4f}{att:>10.2%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"prompt_tokens": len(tokens), "steps": a.steps, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
