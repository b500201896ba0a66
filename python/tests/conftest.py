"""Shared fixtures: the real model (KVSIFT_MODEL, which make test sets) and small caches."""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvsift


@pytest.fixture(scope="session")
def model_path() -> str:
    path = os.environ.get("KVSIFT_MODEL", "")
    if not path or not os.path.exists(path):
        pytest.skip("KVSIFT_MODEL is not set (scripts/fetch_model.sh gives the path)")
    return path


@pytest.fixture(scope="session")
def model(model_path: str) -> kvsift.Model:
    # n_ctx as kvsift-demo's default, so that the demo test compares like with like.
    with kvsift.Model(model_path, n_ctx=8192, n_threads=2) as m:
        yield m


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def random_kv(seed: int, n_tokens: int, n_kv_heads: int, head_dim: int):
    g = rng(seed)
    k = g.standard_normal((n_tokens, n_kv_heads, head_dim), dtype=np.float32)
    v = g.standard_normal((n_tokens, n_kv_heads, head_dim), dtype=np.float32)
    return k, v
