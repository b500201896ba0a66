#!/usr/bin/env python3
"""Quest on a GQA model: is a group's shared page set (kvsift ranks pages by the largest of the
group's Quest bounds) what loses the mass, or Quest's bound itself?

On SmolLM2's real keys, values and queries (the dump of every layer, with values, written by
`KVSIFT_LOCKS_PEER_DUMP_ALL=1 kvsift_tests --gtest_also_run_disabled_tests
--gtest_filter=LocksPeer.DISABLED_dump*`), for each query head of each (layer, KV head, step),
float64 throughout:
  mass recall   the share of the head's exact softmax mass on the pages kept
  output error  ||o_kept - o_dense|| / ||o_dense||, o_kept the exact attention over the kept pages
for these page choices, all with the first and the open/last page kept and the same number of
other pages per KV head:
  quest-max       kvsift's quest: one set per group, ranked by the largest head bound
  quest-mean      one set per group, ranked by the mean head bound
  quest-per-head  every query head its own top pages by its own bound (Quest as written for
                  multi-head attention; reads up to G times as many pages per KV head)
  oracle-share    one set per group by the average over heads of exact page mass shares
  oracle-per-head every query head its own top pages by exact page mass
Prints a JSON report: per budget, per choice, the mean recall, the mean over groups of the worst
head's recall, the share of heads below 0.5 recall, the mean and 90th-percentile output error.

    python3 tools/peer/quest_gqa.py --dump DUMP [--fractions 0.1] [--budgets 512 2048]
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np

import locks_peer_common as common

B = common.PAGE_TOKENS


def exact(q, k, v):
    """Per query head: page masses [G, pages] and the dense output [G, d]."""
    d = q.shape[1]
    s = q @ k.T / math.sqrt(d)
    s = s - s.max(axis=1, keepdims=True)
    w = np.exp(s)
    w /= w.sum(axis=1, keepdims=True)
    n = k.shape[0]
    pages = -(-n // B)
    pad = np.zeros((q.shape[0], pages * B))
    pad[:, :n] = w
    return pad.reshape(q.shape[0], pages, B).sum(-1), w @ v, w


def top(scores, first, last, take):
    sel = np.arange(first, last)
    order = np.lexsort((sel, -scores[first:last]))
    return sel[order[:take]]


def kept_output(w, v, pages_kept, n):
    mask = np.zeros(n, dtype=bool)
    for p in pages_kept:
        mask[p * B:min((p + 1) * B, n)] = True
    wk = np.where(mask, w, 0.0)
    return wk @ v / wk.sum()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dump", required=True)
    p.add_argument("--fractions", type=float, nargs="*", default=[0.1])
    p.add_argument("--budgets", type=int, nargs="*", default=list(common.BUDGETS))
    args = p.parse_args()
    dump = common.read_dump(args.dump)
    meta = dump["header"]
    H, G, d, n_final = meta["n_kv_heads"], meta["group"], meta["head_dim"], meta["keys_tokens"]
    values = np.fromfile(args.dump + ".v", dtype=np.float16)
    values = values.reshape(len(meta["layers"]), H, n_final, d)
    choices = ("quest-max", "quest-mean", "quest-per-head", "oracle-share", "oracle-per-head")
    budgets = [("tokens", b) for b in args.budgets] + [("fraction", f) for f in args.fractions]
    acc = {bk: {c: {"recall": [], "worst": [], "err": []} for c in choices} for bk in budgets}
    for li, layer in enumerate(meta["layers"]):
        for h in range(H):
            keys_all = dump["keys"][(layer, h)].astype(np.float64)
            vals_all = values[li, h].astype(np.float64)
            for step, n in enumerate(meta["tokens"]):
                k, v = keys_all[:n], vals_all[:n]
                q = dump["queries"][(layer, step)][h * G:(h + 1) * G].astype(np.float64)
                mass, dense, w = exact(q, k, v)
                n_pages, first, last = common.selectable_pages(n)
                sealed = n // B
                kp = k[:sealed * B].reshape(sealed, B, d)
                lo, hi = kp.min(axis=1), kp.max(axis=1)
                bound = np.maximum(q[:, None, :] * lo[None], q[:, None, :] * hi[None]).sum(-1)
                shares = mass[:, :last] / mass[:, first:last].sum(axis=1, keepdims=True)
                mandatory = list(range(first)) + list(range(last, n_pages))
                for kind, b in budgets:
                    tokens = b if kind == "tokens" else int(math.floor(b * n))
                    take = min(last - first, max(tokens // B - len(mandatory), 0))
                    per_choice = {
                        "quest-max": [top(bound.max(axis=0), first, last, take)] * G,
                        "quest-mean": [top(bound.mean(axis=0), first, last, take)] * G,
                        "quest-per-head": [top(bound[g], first, last, take) for g in range(G)],
                        "oracle-share": [top(shares.mean(axis=0), first, last, take)] * G,
                        "oracle-per-head": [top(mass[g], first, last, take) for g in range(G)],
                    }
                    for c, sets in per_choice.items():
                        recalls = []
                        for g in range(G):
                            kept = list(sets[g]) + mandatory
                            recalls.append(float(mass[g, kept].sum()))
                            o = kept_output(w[g], v, kept, n)
                            err = np.linalg.norm(o - dense[g]) / np.linalg.norm(dense[g])
                            acc[(kind, b)][c]["err"].append(float(err))
                        acc[(kind, b)][c]["recall"] += recalls
                        acc[(kind, b)][c]["worst"].append(min(recalls))
    report = {"tokens": meta["tokens"], "layers": len(meta["layers"]), "kv_heads": H,
              "group": G, "head_dim": d, "budgets": {}}
    for (kind, b), per in acc.items():
        key = f"{b} tokens" if kind == "tokens" else f"{b:.0%} of the context"
        report["budgets"][key] = {
            c: {"recall_mean": round(float(np.mean(m["recall"])), 4),
                "worst_head_recall_mean": round(float(np.mean(m["worst"])), 4),
                "heads_below_0.5": round(float(np.mean(np.array(m["recall"]) < 0.5)), 4),
                "output_error_mean": round(float(np.mean(m["err"])), 4),
                "output_error_p90": round(float(np.quantile(m["err"], 0.9)), 4)}
            for c, m in per.items()}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
