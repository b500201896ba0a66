"""Cache.select against the C API's own attend_selected, for every selector."""

from __future__ import annotations

import numpy as np
import pytest

import kvsift
from conftest import rng

H, G, D, B = 2, 2, 64, 16
BUDGETS = {"dense": 0.0, "oracle": 0.2, "quest": 0.2, "locks": 0.2, "locks_certified": 0.5,
           "louver": 0.2, "s4r": 0.2}
TOKEN_LEVEL = {"louver", "s4r"}


def make_cache() -> kvsift.Cache:
    # Pre-RoPE keys, which S4R needs and the others accept.
    return kvsift.Cache(n_layers=2, n_kv_heads=H, group_size=G, head_dim=D, page_tokens=B,
                        key_form="pre_rope", max_pages=1024, max_batch=4, n_threads=2)


def append_all(caches, seqs, n_tokens, seed):
    for i, _ in enumerate(seqs):
        for layer in range(2):
            g = rng(seed + 97 * i + 13 * layer)
            k = g.standard_normal((n_tokens, H, D), dtype=np.float32)
            v = g.standard_normal((n_tokens, H, D), dtype=np.float32)
            k[7::61] *= 4  # a few loud keys, so that choices are not just the first pages
            for cache, cache_seqs in caches:
                cache.append(cache_seqs[i], layer, k, v)


def reference(plain, seq, layer, head, positions, q_group):
    """float64 attention of a group's query heads over token positions read back from `plain`."""
    k = np.stack([plain.read_tokens(seq, layer, head, int(t), 1)[0][0] for t in positions])
    v = np.stack([plain.read_tokens(seq, layer, head, int(t), 1)[1][0] for t in positions])
    logits = q_group.astype(np.float64) @ k.astype(np.float64).T / np.sqrt(D)
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (w / w.sum(axis=1, keepdims=True)) @ v.astype(np.float64)


@pytest.mark.parametrize("selector", list(kvsift.SELECTORS))
def test_select_returns_what_attend_selected_attends_to(selector):
    assert set(kvsift.SELECTORS) == set(BUDGETS)
    # `selected` attends with attend_selected, `selecting` selects, `plain` keeps every token.
    selected, selecting, plain = make_cache(), make_cache(), make_cache()
    seqs = [[c.create_sequence() for _ in range(2)] for c in (selected, selecting, plain)]
    policy = kvsift.SelectorPolicy(selector=selector, budget=BUDGETS[selector], compression=1.0)
    selected.set_selector(policy)
    selecting.set_selector(policy)
    caches = list(zip((selected, selecting, plain), seqs))
    append_all(caches, seqs[0], 40 * B + 5, 11)
    for step in range(3):
        if step:
            append_all(caches, seqs[0], 1, 1000 + step)
        for layer in range(2):
            q = rng(77 + 10 * step + layer).standard_normal((2, H * G, D), dtype=np.float32) * 2
            out, stats = selected.attend_selected(layer, seqs[0], q)
            sel = selecting.select(layer, seqs[1], q)
            assert isinstance(sel, kvsift.Selection)
            length = plain.sequence_length(seqs[2][0], layer)
            n_pages = -(-length // B)
            assert sel.stats.pairs == stats.pairs == 2 * H
            assert sel.stats.pages_chosen == stats.pages_chosen == len(sel.page_ids)
            assert sel.stats.pages_stored == stats.pages_stored == 2 * H * n_pages
            assert sel.stats.index_bytes_read == stats.index_bytes_read
            assert sel.stats.kv_bytes_read == 0
            assert np.isnan(stats.kept_estimate) == np.isnan(sel.stats.kept_estimate)
            if not np.isnan(stats.kept_estimate):
                assert sel.stats.kept_estimate == stats.kept_estimate
            assert np.isnan(sel.kept_estimate).all() == np.isnan(stats.kept_estimate)
            if selector not in TOKEN_LEVEL:
                assert len(sel.token_positions) == 0 and sel.token_offsets[-1] == 0
                from_list = selecting.attend(layer, seqs[1], q, pages=sel.page_list())
                np.testing.assert_array_equal(from_list, out)  # bit for bit
                continue
            # Token level: attention over the listed pages and positions, recomputed in float64.
            for i in range(2):
                for h in range(H):
                    pages = sel.pages(i, h)
                    tokens = sel.tokens(i, h)
                    assert len(tokens) > 0
                    assert np.all(np.diff(tokens.astype(np.int64)) > 0)
                    in_pages = np.concatenate(
                        [np.arange(p * B, min(length, p * B + B)) for p in pages])
                    assert not np.isin(tokens, in_pages).any()
                    positions = np.concatenate([in_pages, tokens])
                    ref = reference(plain, seqs[2][i], layer, h, positions,
                                    q[i, h * G:(h + 1) * G])
                    got = out[i, h * G:(h + 1) * G]
                    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
                    # Louver gathers stored rows; S4R reconstructs them (full rank, fp16).
                    assert err < (1e-5 if selector == "louver" else 2e-3), (step, layer, i, h)
    for c in (selected, selecting, plain):
        c.close()


def test_padded_gives_the_dense_page_table_layout():
    with make_cache() as cache:
        s = [cache.create_sequence() for _ in range(2)]
        append_all([(cache, s)], s, 10 * B, 3)
        cache.set_selector(selector="quest", budget=4 * B)
        q = rng(4).standard_normal((2, H * G, D), dtype=np.float32)
        sel = cache.select(0, s, q)
        table = sel.padded()
        assert table.shape == (2, H, 4) and table.dtype == np.int32
        for i in range(2):
            for h in range(H):
                np.testing.assert_array_equal(table[i, h], sel.pages(i, h))
        assert 0 in table[0, 0] and 9 in table[0, 0]  # the sink and the window


def test_a_default_cache_selects_every_page():
    with make_cache() as cache:
        s = cache.create_sequence()
        append_all([(cache, [s])], [s], 50, 5)
        sel = cache.select(1, [s], np.ones((1, H * G, D), dtype=np.float32))
        for h in range(H):
            np.testing.assert_array_equal(sel.pages(0, h), np.arange(4))
        np.testing.assert_array_equal(sel.kept_estimate, np.ones(H, dtype=np.float32))


def test_sequences_with_no_tokens_select_nothing():
    with make_cache() as cache:
        s = cache.create_sequence()
        sel = cache.select(0, [s], np.ones((1, H * G, D), dtype=np.float32))
        assert len(sel.page_ids) == 0 and len(sel.token_positions) == 0
        np.testing.assert_array_equal(sel.page_offsets, np.zeros(H + 1, dtype=np.uint32))
