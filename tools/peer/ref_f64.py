#!/usr/bin/env python3
"""Exact float64 forward pass of the Q4_1 GGUF (numpy only) compared with the llama.cpp fixture.

Tells how far llama.cpp's logits are from exact arithmetic on the same dequantized weights, i.e. which
tolerances a test of kvsift against tests/data/smollm2_llamacpp.json needs. llama.cpp quantizes
activations to 8 bits inside its matmuls; an fp32 forward pass sits near this reference instead.

    tools/peer/.venv/bin/python tools/peer/ref_f64.py [--model PATH] [--fixture PATH]

Self-contained: its own minimal GGUF v3 reader (F32, Q4_1, Q8_0 tensors), no llama_cpp import.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# GGUF metadata value types -> struct size (scalars); 8 = string, 9 = array
SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_gguf(path):
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    pos = 0

    def u(n):
        nonlocal pos
        v = int.from_bytes(buf[pos:pos + n].tobytes(), "little")
        pos += n
        return v

    def string():
        nonlocal pos
        n = u(8)
        s = buf[pos:pos + n].tobytes().decode("utf-8")
        pos += n
        return s

    def value(t):
        nonlocal pos
        if t in SCALAR:
            raw = buf[pos:pos + SCALAR[t]].tobytes()
            pos += SCALAR[t]
            return np.frombuffer(raw, {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4",
                                       6: "<f4", 7: "u1", 10: "<u8", 11: "<i8", 12: "<f8"}[t])[0]
        if t == 8:
            return string()
        et, n = u(4), u(8)
        if et in SCALAR:  # skip numeric arrays wholesale
            pos += n * SCALAR[et]
            return None
        return [value(et) for _ in range(n)]

    assert buf[:4].tobytes() == b"GGUF", "not a GGUF file"
    pos = 4
    version, n_tensors, n_kv = u(4), u(8), u(8)
    assert version == 3, version
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(u(4))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [u(8) for _ in range(u(4))]
        infos.append((name, dims, u(4), u(8)))
    align = int(meta.get("general.alignment", 32))
    base = (pos + align - 1) // align * align

    tensors = {}
    for name, dims, typ, off in infos:
        n = int(np.prod(dims))
        start = base + off
        if typ == 0:  # F32
            a = np.frombuffer(buf[start:start + 4 * n].tobytes(), "<f4").astype(np.float64)
        elif typ == 3:  # Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; x = d*q + m
            blk = buf[start:start + n // 32 * 20].reshape(-1, 20)
            d = blk[:, 0:2].copy().view("<f2").astype(np.float64)
            m = blk[:, 2:4].copy().view("<f2").astype(np.float64)
            qs = blk[:, 4:20]
            q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float64)
            a = (d * q + m).reshape(-1)
        elif typ == 8:  # Q8_0: fp16 d, 32 int8; x = d*q
            blk = buf[start:start + n // 32 * 34].reshape(-1, 34)
            d = blk[:, 0:2].copy().view("<f2").astype(np.float64)
            q = blk[:, 2:34].copy().view("i1").astype(np.float64)
            a = (d * q).reshape(-1)
        else:
            raise ValueError(f"{name}: ggml type {typ} not supported here")
        tensors[name] = a.reshape(list(reversed(dims)))  # row-major [rows, row_len]
    return meta, tensors


class Model:
    def __init__(self, path):
        meta, self.w = read_gguf(path)
        g = lambda k: meta[f"llama.{k}"]
        self.n_layer = int(g("block_count"))
        self.n_head = int(g("attention.head_count"))
        self.n_kv = int(g("attention.head_count_kv"))
        self.d = int(g("embedding_length"))
        self.hd = self.d // self.n_head
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.theta = float(g("rope.freq_base"))

    def rms(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        # GGUF llama Q/K rows are permuted by the converter: rotate adjacent pairs (2i, 2i+1)
        f = self.theta ** (-2 * np.arange(self.hd // 2) / self.hd)
        ang = pos[:, None] * f[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
        return out

    def logits(self, ids):
        """Logits for every position of ids (no KV cache: the whole sequence each call)."""
        W, T, hd = self.w, len(ids), self.hd
        x = W["token_embd.weight"][ids]
        pos = np.arange(T, dtype=np.float64)
        mask = np.triu(np.full((T, T), -np.inf), 1)
        rep = self.n_head // self.n_kv
        for l in range(self.n_layer):
            p = f"blk.{l}."
            h = self.rms(x, W[p + "attn_norm.weight"])
            q = self.rope((h @ W[p + "attn_q.weight"].T).reshape(T, self.n_head, hd), pos)
            k = self.rope((h @ W[p + "attn_k.weight"].T).reshape(T, self.n_kv, hd), pos)
            v = (h @ W[p + "attn_v.weight"].T).reshape(T, self.n_kv, hd)
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", s, v).reshape(T, self.d)
            x = x + o @ W[p + "attn_output.weight"].T
            h = self.rms(x, W[p + "ffn_norm.weight"])
            g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
            x = x + ((g / (1 + np.exp(-g))) * u) @ W[p + "ffn_down.weight"].T
        out = W["output.weight"] if "output.weight" in W else W["token_embd.weight"]  # tied
        return self.rms(x, W["output_norm.weight"]) @ out.T


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--fixture", default=os.path.join(REPO, "tests", "data", "smollm2_llamacpp.json"))
    args = ap.parse_args()
    path = args.model or subprocess.run(["bash", os.path.join(REPO, "scripts", "fetch_model.sh")],
                                        check=True, capture_output=True, text=True).stdout.strip()
    fx = json.load(open(args.fixture, encoding="utf-8"))
    model = Model(path)

    print("logits: llama.cpp fixture vs float64 (over each position's stored top-50)")
    for L in fx["logits"]:
        ref = model.logits(L["ids"])
        dmax, dlp, same = 0.0, 0.0, 0
        for P in L["positions"]:
            r = ref[P["pos"]]
            lse = r.max() + np.log(np.exp(r - r.max()).sum())
            ids = [t for t, _ in P["top"]]
            got = np.array([v for _, v in P["top"]])
            dmax = max(dmax, np.abs(got - r[ids]).max())
            dlp = max(dlp, np.abs((got - P["logsumexp"]) - (r[ids] - lse)).max())
            same += int(np.argmax(r)) == ids[0]
        print(f"  {L['name']:6s} max|dlogit| {dmax:.3f}  max|dlogprob| {dlp:.3f}  "
              f"top-1 agrees at {same}/{len(L['positions'])} positions")

    print("greedy: float64 argmax path vs the fixture's")
    for G in fx["greedy"]:
        ids, out = list(G["prompt_ids"]), []
        for _ in range(len(G["generated_ids"])):
            t = int(np.argmax(model.logits(ids)[-1]))
            out.append(t)
            ids.append(t)
            if t != G["generated_ids"][len(out) - 1]:
                break
        k = len(out) if out == G["generated_ids"][:len(out)] else len(out) - 1
        note = "" if k == len(G["generated_ids"]) else \
            f" (diverges at step {k}, llama.cpp top1-top2 margin there {G['top1_top2_margin'][k]})"
        print(f"  {G['name']:8s} {k}/{len(G['generated_ids'])} tokens agree{note}")


if __name__ == "__main__":
    sys.exit(main())
