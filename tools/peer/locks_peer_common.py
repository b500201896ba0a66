"""Shared pieces of the LOCKS and Quest peer fixtures (numpy only).

- The synthetic Llama-3.1-8B-shaped keys (head_dim 128, 4 query heads per KV head), generated
  from counter-based integer hashing and sums of uniforms only, so that
  tests/test_locks_peer.cpp regenerates the very same float32 values (and so the same fp16 keys in
  its cache) without storing them: no transcendental function, every double operation in the same
  order on both sides.
- The SmolLM2 dump written by `kvsift_tests --gtest_filter=LocksPeer.DISABLED_dump*` (format in
  read_dump).
- The fixture container: one JSON header line, then a binary blob the header points into
  (little-endian; offsets in bytes from the blob's start).
"""
from __future__ import annotations

import json

import numpy as np

PAGE_TOKENS = 16
BUDGETS = (64, 128, 512, 2048)  # tokens per (layer, KV head), sink and window counted inside
SINK_PAGES = 1
WINDOW_PAGES = 1

# ---- the synthetic generator (mirrored by tests/test_locks_peer.cpp) ----------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_STREAM = np.uint64(0xD1B54A32D192ED03)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SQRT3 = 1.7320508075688772

SYNTH_HEAD_DIM = 128
SYNTH_GROUP = 4
SYNTH_OUTLIERS = (5, 37, 70, 101)  # channels with a large mean, as Llama's keys have


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def stream_id(tag: int, a: int, b: int) -> int:
    return tag * 1000003 + a * 1009 + b


def uniforms(stream: int, n: int) -> np.ndarray:
    """n doubles in (0, 1): the splitmix64 finaliser of stream * C + (i + 1) * golden."""
    with np.errstate(over="ignore"):
        i = np.arange(1, n + 1, dtype=np.uint64)
        x = np.uint64(stream) * _STREAM + i * _GOLDEN
        x = _mix(x)
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * (2.0 ** -53)


def normals(stream: int, n: int) -> np.ndarray:
    """Approximately standard normal: (u0 + u1 + u2 + u3 - 2) * sqrt(3), summed left to right."""
    u = uniforms(stream, 4 * n).reshape(n, 4)
    s = ((u[:, 0] + u[:, 1]) + u[:, 2]) + u[:, 3]
    return (s - 2.0) * _SQRT3


def synthetic_keys(tokens: int, head: int) -> np.ndarray:
    """[tokens, 128] float32 keys of one synthetic KV head: a shared mean with outlier channels, a
    per-page topic of random strength, a page-local rank-4 mixture and noise."""
    d = SYNTH_HEAD_DIM
    pages = (tokens + PAGE_TOKENS - 1) // PAGE_TOKENS
    bias = 0.4 * normals(stream_id(1, head, 0), d)
    for c in SYNTH_OUTLIERS:
        bias[c] = bias[c] + 6.0
    strength = 0.5 + uniforms(stream_id(3, head, tokens), pages)
    topic = normals(stream_id(2, head, tokens), pages * d).reshape(pages, d) * strength[:, None]
    local = normals(stream_id(4, head, tokens), pages * 4 * d).reshape(pages, 4, d)
    mix = normals(stream_id(5, head, tokens), tokens * 4).reshape(tokens, 4)
    noise = normals(stream_id(6, head, tokens), tokens * d).reshape(tokens, d)
    page = np.arange(tokens) // PAGE_TOKENS
    x = bias[None, :] + topic[page]
    for j in range(4):
        x = x + (0.7 * mix[:, j])[:, None] * local[page, j]
    x = x + 0.3 * noise
    return x.astype(np.float32)


def synthetic_queries(keys_topic_tokens: int, head: int, query: int) -> np.ndarray:
    """[4, 128] float32 queries of one KV head's group: each head looks for one page shared by the
    group and one of its own, plus noise; the even heads are also drawn to the first page, the
    attention sink real models have (so that a head's best page is often a sink page, which the
    GQA combines must handle as the authors do). Stored in the fixture, not regenerated."""
    d, G, tokens = SYNTH_HEAD_DIM, SYNTH_GROUP, keys_topic_tokens
    pages = (tokens + PAGE_TOKENS - 1) // PAGE_TOKENS
    strength = 0.5 + uniforms(stream_id(3, head, tokens), pages)
    topic = normals(stream_id(2, head, tokens), pages * d).reshape(pages, d) * strength[:, None]
    bias = 0.4 * normals(stream_id(1, head, 0), d)
    pick = uniforms(stream_id(7, head, tokens * 8 + query), 1 + G)
    shared = 1 + int(pick[0] * (pages - 3))
    noise = normals(stream_id(8, head, tokens * 8 + query), G * d).reshape(G, d)
    q = np.empty((G, d))
    for g in range(G):
        own = 1 + int(pick[1 + g] * (pages - 3))
        sink = 0.35 if g % 2 == 0 else 0.0
        q[g] = (0.3 * topic[shared] + 0.2 * topic[own] + sink * topic[0] + 0.05 * bias
                + 0.6 * noise[g])
    return q.astype(np.float32)


def fp16_checksum(keys_f16: np.ndarray) -> int:
    """Sum of (i + 1) * bits over the fp16 bit patterns, mod 2^64 (the test's identity check)."""
    bits = keys_f16.view(np.uint16).reshape(-1).astype(np.uint64)
    with np.errstate(over="ignore"):
        w = np.arange(1, bits.size + 1, dtype=np.uint64)
        return int(np.sum(bits * w, dtype=np.uint64))


# ---- the SmolLM2 dump ---------------------------------------------------------------------------

def read_dump(path: str) -> dict:
    """The dump: a JSON header line {layers, n_kv_heads, group, head_dim, page_tokens, steps,
    tokens: [context length at each step], keys_tokens}, then for each listed layer and KV head
    the fp16 keys [keys_tokens, head_dim] (the cache after the last step; step s sees the first
    tokens[s]), then for each listed layer and step the float32 queries [n_heads, head_dim]."""
    with open(path, "rb") as f:
        header = json.loads(f.readline())
        blob = f.read()
    L, H, G, d = header["layers"], header["n_kv_heads"], header["group"], header["head_dim"]
    n, steps = header["keys_tokens"], header["steps"]
    at = 0
    keys = {}
    for layer in L:
        for h in range(H):
            size = n * d * 2
            keys[(layer, h)] = np.frombuffer(blob, np.float16, n * d, at).reshape(n, d)
            at += size
    queries = {}
    for layer in L:
        for s in range(steps):
            size = H * G * d * 4
            queries[(layer, s)] = np.frombuffer(blob, np.float32, H * G * d, at).reshape(H * G, d)
            at += size
    assert at == len(blob), (at, len(blob))
    return {"header": header, "keys": keys, "queries": queries}


# ---- the fixture container ----------------------------------------------------------------------

class Blob:
    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def put(self, array: np.ndarray) -> int:
        data = np.ascontiguousarray(array).tobytes()
        pad = (-self.size) % 8
        if pad:
            self.parts.append(b"\0" * pad)
            self.size += pad
        at = self.size
        self.parts.append(data)
        self.size += len(data)
        return at


def write_fixture(path: str, header: dict, blob: Blob) -> None:
    text = json.dumps(header, separators=(",", ":"))
    assert "\n" not in text
    with open(path, "wb") as f:
        f.write(text.encode() + b"\n")
        for part in blob.parts:
            f.write(part)


def selectable_pages(tokens: int) -> tuple[int, int, int]:
    """(n_pages, first, last): the selectable pages are [first, last) (sink and window outside)."""
    n_pages = (tokens + PAGE_TOKENS - 1) // PAGE_TOKENS
    return n_pages, SINK_PAGES, n_pages - WINDOW_PAGES
