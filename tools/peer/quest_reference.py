#!/usr/bin/env python3
"""A short numpy reference of Quest's page selection (Tang et al., 2024, section 3.2), over the
inputs of the LOCKS peer fixture, written to tests/data/locks_peer_quest.bin for
tests/test_locks_peer.cpp.

Quest keeps, per page, the channel-wise minimum m and maximum M of its keys; for a query q the
page's bound on any of its logits is sum_c max(q_c m_c, q_c M_c) (times the attention scale),
computed here in float64 from the stored fp16 keys. Quest was written for multi-head attention,
one query per KV head; on a GQA model kvsift ranks a group's pages by the largest of its heads'
bounds (the "max" combine), and so does this reference. The top pages are chosen as kvsift
chooses for every page selector: budget b tokens per (layer, KV head) with the first and the
last page inside it, b / 16 - 2 pages picked from the rest, ties to the lower page id.

    python3 tools/peer/quest_reference.py --dump DUMP --out tests/data/locks_peer_quest.bin
"""
from __future__ import annotations

import argparse
import math

import numpy as np

import locks_peer_common as common

SYNTH_CONTEXTS = (16384 + 5, 32768 + 9, 65536 + 3)
SYNTH_HEADS = (0, 1)
SYNTH_QUERIES = 2
SCORE_SAMPLE = 64  # random pages whose bounds are stored, besides every chosen one


def page_bounds(keys_f16: np.ndarray, sealed: int) -> tuple[np.ndarray, np.ndarray]:
    k = keys_f16[:sealed * common.PAGE_TOKENS].astype(np.float64)
    k = k.reshape(sealed, common.PAGE_TOKENS, -1)
    return k.min(axis=1), k.max(axis=1)


def quest_scores(lo: np.ndarray, hi: np.ndarray, q: np.ndarray) -> np.ndarray:
    """[G, pages]: scale * sum_c max(q_c lo_c, q_c hi_c)."""
    q = q.astype(np.float64)
    d = q.shape[1]
    a = q[:, None, :] * lo[None]
    b = q[:, None, :] * hi[None]
    return np.maximum(a, b).sum(-1) / math.sqrt(d)


def choose(combined: np.ndarray, tokens: int, budget: int) -> np.ndarray:
    """Page ids kept: sinks, window and the top selectable pages (ties to the lower id)."""
    n_pages, first, last = common.selectable_pages(tokens)
    take = min(last - first, max(budget // common.PAGE_TOKENS - (n_pages - (last - first)), 0))
    sel = np.arange(first, last)
    order = np.lexsort((sel, -combined[first:last]))  # by score descending, then page id
    kept = set(range(first)) | set(range(last, n_pages)) | set(sel[order[:take]].tolist())
    return np.array(sorted(kept), dtype=np.uint16)


def put_case(blob, header, rng, dataset, layer, h, step, tokens, q, lo, hi):
    n_pages, first, last = common.selectable_pages(tokens)
    scores = quest_scores(lo[:last], hi[:last], q)
    combined = scores.max(axis=0)
    chosen = [choose(combined, tokens, b) for b in common.BUDGETS]
    picked = np.concatenate([c[c < last] for c in chosen])
    sample = np.unique(np.concatenate(
        [picked, rng.choice(last, min(SCORE_SAMPLE, last), replace=False)])).astype(np.uint16)
    taus = []
    for b in common.BUDGETS:
        take = b // common.PAGE_TOKENS - 2
        taus.append(float(np.sort(combined[first:last])[::-1][take - 1]))
    header["cases"].append({
        "dataset": dataset, "layer": layer, "kv_head": h, "step": step, "tokens": tokens,
        "n_pages": n_pages, "n_scored": last, "group": int(q.shape[0]),
        "q": blob.put(q.astype(np.float32)),
        "score_pages": blob.put(sample), "n_score_pages": int(sample.size),
        "head_scores": blob.put(scores[:, sample.astype(np.int64)].astype(np.float32)),
        "tau_max": taus,
        "chosen": {"max": [[blob.put(c), int(c.size)] for c in chosen]}})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dump", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rng = np.random.default_rng(11)
    header = {"format": "kvsift-quest-peer-1", "page_tokens": common.PAGE_TOKENS,
              "budgets": list(common.BUDGETS), "combine": "max", "datasets": [], "cases": []}
    blob = common.Blob()

    dump = common.read_dump(args.dump)
    meta = dump["header"]
    H, G, d = meta["n_kv_heads"], meta["group"], meta["head_dim"]
    header["datasets"].append({"name": "smollm2", "kind": "smollm2", "layers": meta["layers"],
                               "tokens": meta["tokens"], "head_dim": d, "group": G, "n_kv": H})
    for layer in meta["layers"]:
        for h in range(H):
            keys = dump["keys"][(layer, h)]
            for step, tokens in enumerate(meta["tokens"]):
                lo, hi = page_bounds(keys, tokens // common.PAGE_TOKENS)
                q = dump["queries"][(layer, step)][h * G:(h + 1) * G]
                put_case(blob, header, rng, 0, layer, h, step, tokens, q, lo, hi)

    for tokens in SYNTH_CONTEXTS:
        index = len(header["datasets"])
        header["datasets"].append({"name": f"synthetic-{tokens}", "kind": "synthetic",
                                   "tokens": tokens, "heads": list(SYNTH_HEADS),
                                   "head_dim": common.SYNTH_HEAD_DIM, "group": common.SYNTH_GROUP,
                                   "n_kv": len(SYNTH_HEADS)})
        for i, h in enumerate(SYNTH_HEADS):
            keys = common.synthetic_keys(tokens, h).astype(np.float16)
            lo, hi = page_bounds(keys, tokens // common.PAGE_TOKENS)
            for s in range(SYNTH_QUERIES):
                q = common.synthetic_queries(tokens, h, s)
                put_case(blob, header, rng, index, 0, i, s, tokens, q, lo, hi)
    common.write_fixture(args.out, header, blob)
    print(f"{len(header['cases'])} cases, {blob.size} bytes of arrays")


if __name__ == "__main__":
    main()
