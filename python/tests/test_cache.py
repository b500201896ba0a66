"""Cache, append and attention against float64 numpy references."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvsift
from conftest import random_kv, rng

GEOMETRY = dict(n_layers=2, n_kv_heads=2, group_size=3, head_dim=64, page_tokens=16)


def reference_attention(k: np.ndarray, v: np.ndarray, q: np.ndarray, group: int) -> np.ndarray:
    """float64 softmax(q K^T / sqrt(d)) V per query head. k, v: [n, H, d]; q: [H * group, d]."""
    k64, v64, q64 = k.astype(np.float64), v.astype(np.float64), q.astype(np.float64)
    out = np.empty_like(q64)
    for h in range(q.shape[0]):
        kv = h // group
        logits = k64[:, kv, :] @ q64[h] / np.sqrt(q.shape[1])
        w = np.exp(logits - logits.max())
        out[h] = (w / w.sum()) @ v64[:, kv, :]
    return out


def stored(cache: kvsift.Cache, seq: int, layer: int, n: int):
    """K and V as the cache stores them (rounded to fp16), [n, H, d]."""
    ks, vs = zip(*(cache.read_tokens(seq, layer, h, 0, n) for h in range(cache.n_kv_heads)))
    return np.stack(ks, axis=1), np.stack(vs, axis=1)


def test_attention_over_every_token_matches_a_float64_reference():
    with kvsift.Cache(**GEOMETRY, max_batch=4) as cache:
        seqs = [cache.create_sequence() for _ in range(3)]
        lengths = [1, 37, 300]
        for s, n in zip(seqs, lengths):
            for layer in range(2):
                k, v = random_kv(s * 10 + layer, n, 2, 64)
                cache.append(s, layer, k, v)
                assert cache.sequence_length(s, layer) == n
        q = rng(5).standard_normal((3, 6, 64), dtype=np.float32)
        for layer in range(2):
            out = cache.attend(layer, seqs, q)
            assert out.shape == (3, 6, 64) and out.dtype == np.float32
            for i, (s, n) in enumerate(zip(seqs, lengths)):
                k, v = stored(cache, s, layer, n)
                ref = reference_attention(k, v, q[i], 3)
                err = np.linalg.norm(out[i] - ref) / np.linalg.norm(ref)
                assert err < 1e-5, (layer, s, err)


# The avx512_vnni level attends a q8 cache with integer products (the query rounded to 15 bits,
# each page's weights to 8: simd/x86/attend_avx512_vnni.cpp), within a few 1e-3 of float64 over
# the stored values; the other levels compute in float32.
@pytest.mark.parametrize("isa", ["auto", "avx2"])
def test_a_q8_cache_stores_rows_within_half_a_scale_and_attends_over_them(isa):
    level = kvsift.isa_supported() if isa == "auto" else isa
    if isa != "auto" and kvsift.isa_supported() == "scalar":
        pytest.skip("no AVX2 here")
    with kvsift.Cache(**GEOMETRY, dtype="q8", isa=isa) as cache:
        s = cache.create_sequence()
        k, v = random_kv(3, 37, 2, 64)
        cache.append(s, 0, k, v)
        ks, vs = stored(cache, s, 0, 37)
        for given, got in ((k, ks), (v, vs)):
            half_scale = np.abs(given).max(axis=2, keepdims=True) / 127 / 2
            assert np.all(np.abs(got - given) <= half_scale * (1 + 1e-6))
        q = rng(4).standard_normal((1, 6, 64), dtype=np.float32)
        out = cache.attend(0, [s], q)
        ref = reference_attention(ks, vs, q[0], 3)
        tolerance = 1e-2 if level == "avx512_vnni" else 1e-5
        assert np.linalg.norm(out[0] - ref) / np.linalg.norm(ref) < tolerance


def test_stored_values_are_the_inputs_rounded_to_fp16():
    with kvsift.Cache(**GEOMETRY) as cache:
        s = cache.create_sequence()
        k, v = random_kv(1, 20, 2, 64)
        cache.append(s, 0, k, v)
        ks, vs = stored(cache, s, 0, 20)
        np.testing.assert_array_equal(ks, k.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(vs, v.astype(np.float16).astype(np.float32))


def test_page_lists_attend_over_exactly_the_listed_pages():
    with kvsift.Cache(**GEOMETRY) as cache:
        s = cache.create_sequence()
        k, v = random_kv(2, 100, 2, 64)  # 7 pages, the last partial
        cache.append(s, 0, k, v)
        ks, vs = stored(cache, s, 0, 100)
        q = rng(3).standard_normal((1, 6, 64), dtype=np.float32)
        offsets = np.array([0, 3, 5], dtype=np.uint32)
        ids = np.array([0, 2, 6, 1, 4], dtype=np.uint32)
        out = cache.attend(0, [s], q, pages=(offsets, ids))
        for h, pages in enumerate(([0, 2, 6], [1, 4])):
            rows = np.concatenate([np.arange(p * 16, min(100, p * 16 + 16)) for p in pages])
            for g in range(3):
                head = h * 3 + g
                ref = reference_attention(ks[rows][:, h:h + 1], vs[rows][:, h:h + 1],
                                          q[0, head:head + 1], 1)
                np.testing.assert_allclose(out[0, head], ref[0], rtol=1e-5, atol=1e-6)


def test_arrays_are_read_and_written_in_place():
    with kvsift.Cache(**GEOMETRY) as cache:
        s = cache.create_sequence()
        k, v = random_kv(4, 50, 2, 64)
        cache.append(s, 0, k.reshape(50, 128), v)  # a flat last axis is accepted too
        q = rng(6).standard_normal((1, 6, 64), dtype=np.float32)
        out = np.full((1, 6, 64), np.nan, dtype=np.float32)
        result = cache.attend(0, [s], q, out=out)
        assert np.shares_memory(result, out)
        assert np.isfinite(out).all()
        # A read-only input is fine (nothing writes to it).
        q.setflags(write=False)
        np.testing.assert_array_equal(cache.attend(0, [s], q), out)


def test_dlpack_producers_such_as_torch_cpu_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    with kvsift.Cache(**GEOMETRY) as cache:
        s = cache.create_sequence()
        k, v = random_kv(7, 40, 2, 64)
        cache.append(s, 0, torch.from_numpy(k), torch.from_numpy(v))
        q = rng(8).standard_normal((1, 6, 64), dtype=np.float32)
        out = torch.zeros((1, 6, 64), dtype=torch.float32)
        cache.attend(0, [s], torch.from_numpy(q), out=out)
        np.testing.assert_array_equal(out.numpy(), cache.attend(0, [s], q))


def test_stats_are_a_dataclass_of_the_pool_and_the_last_call():
    with kvsift.Cache(**GEOMETRY) as cache:
        s = cache.create_sequence()
        k, v = random_kv(9, 33, 2, 64)
        cache.append(s, 0, k, v)
        cache.attend(0, [s], np.zeros((1, 6, 64), dtype=np.float32))
        st = cache.stats()
        assert isinstance(st, kvsift.CacheStats)
        assert st.n_sequences == 1
        assert st.pages_in_use == 3 * 2  # 33 tokens: 3 pages per KV head
        assert st.last_tokens_read == 33 * 2
        assert st.page_bytes == 2 * 16 * 64 * 2


def test_calls_from_several_threads_on_one_handle_are_serialised():
    with kvsift.Cache(**GEOMETRY, max_batch=1) as cache:
        s = cache.create_sequence()
        k, v = random_kv(10, 500, 2, 64)
        cache.append(s, 0, k, v)
        q = rng(11).standard_normal((1, 6, 64), dtype=np.float32)
        expected = cache.attend(0, [s], q)
        results = []

        def work():
            for _ in range(50):
                results.append(cache.attend(0, [s], q))

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 200
        for r in results:
            np.testing.assert_array_equal(r, expected)


class DLPackOnly:
    """A producer known only by the DLPack protocol (as a CPU torch tensor is)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_any_dlpack_producer_is_read_in_place():
    with kvsift.Cache(**GEOMETRY) as cache:
        s = cache.create_sequence()
        k, v = random_kv(12, 40, 2, 64)
        cache.append(s, 0, DLPackOnly(k), DLPackOnly(v))
        q = rng(13).standard_normal((1, 6, 64), dtype=np.float32)
        np.testing.assert_array_equal(cache.attend(0, [s], DLPackOnly(q)), cache.attend(0, [s], q))


def test_long_calls_release_the_gil():
    import time

    # The scalar kernels on one thread make one call long (about 0.1-0.3 s here); while it runs
    # without the GIL the main thread keeps running Python, so the longest pause it sees is far
    # shorter than the call. Holding the GIL would pause it for the whole call.
    with kvsift.Cache(n_kv_heads=8, group_size=4, head_dim=128, max_batch=1, n_threads=1,
                      isa="scalar") as cache:
        s = cache.create_sequence()
        k, v = random_kv(14, 16384, 8, 128)
        cache.append(s, 0, k, v)
        del k, v
        q = rng(15).standard_normal((1, 32, 128), dtype=np.float32)
        t0 = time.perf_counter()
        cache.attend(0, [s], q)
        call = time.perf_counter() - t0
        done = threading.Event()
        worker = threading.Thread(target=lambda: (cache.attend(0, [s], q), done.set()))
        worker.start()
        last, longest = time.perf_counter(), 0.0
        while not done.is_set():
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        worker.join()
        assert call > 0.02, call
        assert longest < call / 2, (longest, call)


def test_inputs_of_other_dtypes_are_converted_but_out_must_be_float32():
    with kvsift.Cache(**GEOMETRY) as cache:
        s = cache.create_sequence()
        k, v = random_kv(16, 10, 2, 64)
        cache.append(s, 0, k.astype(np.float64), v)
        np.testing.assert_array_equal(stored(cache, s, 0, 10)[0],
                                      k.astype(np.float16).astype(np.float32))
        q = np.ones((1, 6, 64), dtype=np.float32)
        with pytest.raises(TypeError):
            cache.attend(0, [s], q, out=np.zeros((1, 6, 64), dtype=np.float64))
        with pytest.raises(TypeError):
            cache.attend(0, [s], q, out=np.zeros((64, 6, 1), dtype=np.float32).T)
