#!/usr/bin/env python3
"""Runs the LOCKS authors' own selection path on kvsift's inputs and writes the fixture
tests/data/locks_peer.bin that tests/test_locks_peer.cpp compares kvsift's LOCKS against.

The authors' package (locks-kv, Apache-2.0) is imported at run time from --locks-src (its `src`
folder); nothing of it is copied here. What is called, per layer (all KV heads at once):
  summary build + quantisation  locks.selection.rki4_build._rki4_write (torch.linalg.eigh)
  page scores (int8 query)      locks.selection.rki4_score_torch.rki4_score_torch
  per-step page parameters      locks.selection.select.derive_page_params (Triton; needs CUDA)
  top-b with sink and window    locks.selection.select._topb_select_torch
  GQA combine                   "max": torch.amax over the group, as rki4_score_cuda.rki4_select_only;
                                "nrm": the fused CUDA kernel select_cuda.nrmtopb_select_cuda when
                                --cuda-combine builds it, and always a torch transcription of its
                                formula (score = sum_g exp(s_g - max over pages [0, n_sel_hi) of
                                s_g), heads in ascending order), whose agreement with the kernel
                                is recorded in the report.
Budgets b (tokens, sink and window inside, as the paper's tables) map to the code's
budget_pages = b / 16 - 2.

Inputs: the SmolLM2 dump (kvsift_tests --gtest_also_run_disabled_tests
--gtest_filter=LocksPeer.DISABLED_dump_smollm2_keys_and_queries with KVSIFT_LOCKS_PEER_DUMP set)
and the synthetic Llama-shaped keys of locks_peer_common.py.

    python3 tools/peer/locks_reference.py --locks-src PATH/locks-kv/src --dump DUMP \
        --out tests/data/locks_peer.bin [--device cuda] [--cuda-combine] [--report REPORT.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

import locks_peer_common as common

SYNTH_CONTEXTS = (16384 + 5, 32768 + 9, 65536 + 3)
SYNTH_HEADS = (0, 1)
SYNTH_QUERIES = 2
SCORE_SAMPLE = 64  # random pages whose per-head scores are stored, besides every chosen one
SUMMARY_SAMPLE = 3        # pages whose quantised summary is stored, per (layer, KV head)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--locks-src", required=True, help="the authors' package's src folder")
    p.add_argument("--dump", required=True, help="SmolLM2 keys and queries dumped by kvsift")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cuda-combine", action="store_true",
                   help="also build and run the authors' fused CUDA nrm+top-b kernel")
    p.add_argument("--report", default=None, help="JSON with timings and kernel agreement")
    return p.parse_args()


class Reference:
    def __init__(self, args):
        sys.path.insert(0, args.locks_src)
        import torch
        from locks.selection import rki4_build, rki4_score_torch, select
        from locks.selection.rki4_state import Rki4State, IBITS, RNK
        assert IBITS == 4 and RNK == 8, "run with the default LOCKS_RKI4_IBITS / LOCKS_RKI4_RANK"
        self.torch, self.build, self.score_mod, self.select = torch, rki4_build, rki4_score_torch, select
        self.State = Rki4State
        self.device = torch.device(args.device)
        self.cuda_combine = args.cuda_combine and self.device.type == "cuda"
        self.kernel_agree = {"cases": 0, "score_maxabs": 0.0, "sets_equal": 0, "sets_total": 0}
        if self.cuda_combine:
            from locks.selection import rki4_score_cuda, select_cuda
            self.rki4_score_cuda, self.select_cuda = rki4_score_cuda, select_cuda
            t = time.time()
            select_cuda._get()
            self.kernel_build_s = time.time() - t

    def state(self, n_kv, G, d, n_blocks, max_pages):
        return self.State(self.device, num_layers=1, num_blocks=n_blocks, n_kv=n_kv, G=G,
                          head_dim=d, page=common.PAGE_TOKENS, max_reqs=1, max_pages=max_pages,
                          budget_pages=1, sink_pages=common.SINK_PAGES,
                          window_pages=common.WINDOW_PAGES, combine="nrm")

    def build_summaries(self, st, keys_f16):
        """keys_f16: [n_kv, tokens, d] fp16 numpy; summarises every complete page."""
        torch = self.torch
        n_kv, n, d = keys_f16.shape
        pages = n // common.PAGE_TOKENS
        k = torch.from_numpy(np.ascontiguousarray(keys_f16[:, :pages * common.PAGE_TOKENS]))
        kp = k.reshape(n_kv, pages, common.PAGE_TOKENS, d).permute(1, 2, 0, 3).contiguous()
        lidx = torch.zeros(pages, dtype=torch.int64, device=self.device)
        bidx = torch.arange(pages, dtype=torch.int64, device=self.device)
        self.build._rki4_write(st, kp.to(self.device), lidx, bidx)

    def derive(self, st, tokens, budget_tokens):
        torch = self.torch
        st.budget_abs = budget_tokens // common.PAGE_TOKENS - common.SINK_PAGES - common.WINDOW_PAGES
        seq_lens = torch.tensor([tokens], dtype=torch.int32, device=self.device)
        if self.device.type == "cuda":
            self.select.derive_page_params(st, seq_lens, 1)
        else:  # the Triton kernel's arithmetic, for CPU dry runs only
            npg = -(-tokens // common.PAGE_TOKENS)
            nsh = npg - st.window_pages
            s = nsh - st.sink_pages
            st.n_pages[0], st.n_sel_hi[0] = npg, nsh
            st.b_fix[0] = max(min(st.budget_abs, max(s, 1)), 1)
        return seq_lens

    def score(self, st, q, tokens, d):
        torch = self.torch
        seq_lens = self.derive(st, tokens, common.BUDGETS[0])
        table = torch.arange(st.max_pages, dtype=torch.int32, device=self.device)[None]
        self.score_mod.rki4_score_torch(st, 0, torch.from_numpy(q)[None].to(self.device), table,
                                        seq_lens, 1, 1.0 / math.sqrt(d))
        nsh = int(st.n_sel_hi[0])
        return st.score_h[0, :, :, :nsh].double().cpu().numpy().astype(np.float32), nsh

    def nrm_torch(self, st):
        torch = self.torch
        nsh = int(st.n_sel_hi[0])
        sh = st.score_h[0, :, :, :nsh]
        hm = sh.amax(-1, keepdim=True)
        acc = torch.zeros_like(sh[:, 0])
        for g in range(sh.shape[1]):
            acc = acc + torch.exp(sh[:, g] - hm[:, g])
        st.score.fill_(float("-inf"))
        st.score[0, :, :nsh] = acc

    def chosen(self, st):
        self.select._topb_select_torch(st, 1)
        out = []
        for h in range(st.n_kv):
            cnt = int(st.page_cnt[0, h])
            out.append(st.page_table[0, h, :cnt].cpu().numpy().astype(np.uint16))
        return out

    def select_all(self, st, tokens):
        """{combine: [budget][kv_head] -> chosen page ids}, and the authors' nrm threshold tau
        (the b-th largest combined score) per budget and KV head."""
        torch = self.torch
        result = {"nrm": [], "max": []}
        tau = []
        for b in common.BUDGETS:
            self.derive(st, tokens, b)
            nsh, bfix = int(st.n_sel_hi[0]), int(st.b_fix[0])
            self.nrm_torch(st)
            combined = st.score[0, :, common.SINK_PAGES:nsh]
            tau.append([float(torch.topk(combined[h], bfix).values[-1]) for h in range(st.n_kv)])
            nrm_scores = st.score[0, :, :nsh].clone()
            result["nrm"].append(self.chosen(st))
            if self.cuda_combine:
                self.rki4_score_cuda._ensure_hmax(st)
                self.select_cuda.nrmtopb_select_cuda(st, 1, has_hmax=False)
                kernel = []
                for h in range(st.n_kv):
                    cnt = int(st.page_cnt[0, h])
                    kernel.append(st.page_table[0, h, :cnt].cpu().numpy().astype(np.uint16))
                a = self.kernel_agree
                a["cases"] += 1
                diff = (st.score[0, :, common.SINK_PAGES:nsh] - nrm_scores[:, common.SINK_PAGES:])
                rel = diff.abs() / nrm_scores[:, common.SINK_PAGES:].abs().clamp_min(1e-30)
                a["score_maxabs"] = max(a["score_maxabs"], float(rel.max()))
                for x, y in zip(kernel, result["nrm"][-1]):
                    a["sets_total"] += 1
                    a["sets_equal"] += int(np.array_equal(x, y))
            torch.amax(st.score_h, dim=2, out=st.score)
            result["max"].append(self.chosen(st))
        return result, tau

    def summary_fields(self, st, h, page):
        return {name: getattr(st, name)[0, page, h].cpu().contiguous().reshape(-1)
                .view(self.torch.uint8).numpy().copy()
                for name in ("pp_v4", "pp_vs", "pp_c8", "pp_cs", "pp_mu8", "pp_mus")}


def put_case(blob, header, rng, dataset, layer, h, step, tokens, q_group, head_scores, nsh,
             choice, tau):
    G = q_group.shape[0]
    n_pages, first, last = common.selectable_pages(tokens)
    assert nsh == last
    picked = np.concatenate([ids[h] for per_b in choice.values() for ids in per_b])
    pages = np.unique(np.concatenate([picked[picked < nsh].astype(np.int64),
                                      rng.choice(nsh, min(SCORE_SAMPLE, nsh), replace=False)]))
    case = {"dataset": dataset, "layer": layer, "kv_head": h, "step": step, "tokens": tokens,
            "n_pages": n_pages, "n_scored": nsh, "group": G,
            "q": blob.put(q_group.astype(np.float32)),
            "score_pages": blob.put(pages.astype(np.uint16)), "n_score_pages": int(pages.size),
            "head_scores": blob.put(head_scores[:, pages.astype(np.int64)].astype(np.float32)),
            "tau_nrm": [t[h] for t in tau], "chosen": {}}
    for combine, per_budget in choice.items():
        case["chosen"][combine] = [[blob.put(ids[h]), int(ids[h].size)] for ids in per_budget]
    header["cases"].append(case)


def put_pages(blob, header, ref, st, dataset, layer, n_kv, n_complete):
    picks = sorted({0, n_complete // 2, n_complete - 1})[:SUMMARY_SAMPLE]
    for h in range(n_kv):
        for p in picks:
            fields = ref.summary_fields(st, h, p)
            entry = {"dataset": dataset, "layer": layer, "kv_head": h, "page": int(p)}
            for name, data in fields.items():
                entry[name] = blob.put(data)
            header["pages"].append(entry)


def run_smollm2(ref, blob, header, dump_path, rng):
    dump = common.read_dump(dump_path)
    meta = dump["header"]
    H, G, d = meta["n_kv_heads"], meta["group"], meta["head_dim"]
    index = len(header["datasets"])
    header["datasets"].append({"name": "smollm2", "kind": "smollm2", "head_dim": d, "group": G,
                               "n_kv": H, "layers": meta["layers"], "steps": meta["steps"],
                               "tokens": meta["tokens"], "keys_tokens": meta["keys_tokens"],
                               "key_checksums": {}})
    for layer in meta["layers"]:
        keys = np.stack([dump["keys"][(layer, h)] for h in range(H)])
        for h in range(H):
            header["datasets"][index]["key_checksums"][f"{layer}/{h}"] = \
                str(common.fp16_checksum(keys[h]))
        n_final = meta["keys_tokens"]
        st = ref.state(H, G, d, n_final // common.PAGE_TOKENS, -(-n_final // common.PAGE_TOKENS))
        ref.build_summaries(st, keys)
        put_pages(blob, header, ref, st, index, layer, H, n_final // common.PAGE_TOKENS)
        for step, tokens in enumerate(meta["tokens"]):
            q = dump["queries"][(layer, step)]
            scores, nsh = ref.score(st, q, tokens, d)
            choice, tau = ref.select_all(st, tokens)
            for h in range(H):
                put_case(blob, header, rng, index, layer, h, step, tokens,
                         q[h * G:(h + 1) * G], scores[h], nsh, choice, tau)


def run_synthetic(ref, blob, header, rng):
    d, G = common.SYNTH_HEAD_DIM, common.SYNTH_GROUP
    for tokens in SYNTH_CONTEXTS:
        index = len(header["datasets"])
        header["datasets"].append({"name": f"synthetic-{tokens}", "kind": "synthetic",
                                   "head_dim": d, "group": G, "n_kv": len(SYNTH_HEADS),
                                   "heads": list(SYNTH_HEADS), "tokens": tokens,
                                   "key_checksums": {}})
        keys = np.stack([common.synthetic_keys(tokens, h).astype(np.float16)
                         for h in SYNTH_HEADS])
        for i, h in enumerate(SYNTH_HEADS):
            header["datasets"][index]["key_checksums"][str(h)] = str(common.fp16_checksum(keys[i]))
        H = len(SYNTH_HEADS)
        n_pages = -(-tokens // common.PAGE_TOKENS)
        st = ref.state(H, G, d, tokens // common.PAGE_TOKENS, n_pages)
        ref.build_summaries(st, keys)
        put_pages(blob, header, ref, st, index, 0, H, tokens // common.PAGE_TOKENS)
        for s in range(SYNTH_QUERIES):
            q = np.concatenate([common.synthetic_queries(tokens, h, s) for h in SYNTH_HEADS])
            scores, nsh = ref.score(st, q, tokens, d)
            choice, tau = ref.select_all(st, tokens)
            for i, h in enumerate(SYNTH_HEADS):
                put_case(blob, header, rng, index, 0, i, s, tokens, q[i * G:(i + 1) * G],
                         scores[i], nsh, choice, tau)


def main():
    args = parse_args()
    t0 = time.time()
    ref = Reference(args)
    header = {"format": "kvsift-locks-peer-1", "page_tokens": common.PAGE_TOKENS, "rank": 8,
              "sink_pages": common.SINK_PAGES, "window_pages": common.WINDOW_PAGES,
              "budgets": list(common.BUDGETS), "combines": ["nrm", "max"],
              "device": str(ref.device), "torch": ref.torch.__version__,
              "datasets": [], "cases": [], "pages": []}
    blob = common.Blob()
    rng = np.random.default_rng(7)
    run_smollm2(ref, blob, header, args.dump, rng)
    t1 = time.time()
    run_synthetic(ref, blob, header, rng)
    t2 = time.time()
    common.write_fixture(args.out, header, blob)
    report = {"smollm2_s": t1 - t0, "synthetic_s": t2 - t1, "cases": len(header["cases"]),
              "pages": len(header["pages"]), "blob_bytes": blob.size,
              "kernel_agreement": ref.kernel_agree if ref.cuda_combine else None,
              "kernel_build_s": getattr(ref, "kernel_build_s", None)}
    print(json.dumps(report))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
