"""The paged host KV cache: sequences, append, exact attention, selectors and selection."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _core

_DEFAULTS = _core.policy_defaults()


@dataclass
class SelectorPolicy:
    """Which pages (or tokens) each decode step attends to: ``kvsift_selector_policy``.

    ``selector`` is one of :data:`kvsift.SELECTORS`. ``budget`` is tokens per (layer, KV head)
    per step, sink and window pages counted inside: a fraction of the context when in (0, 1], a
    token count above 1; the dense selector takes none (0). The other fields keep the C API's
    meaning and defaults (kvsift.h, README "Selectors"): ``int8_query`` and ``epsilon`` are
    ``kvsift_selector_policy.locks``'s, ``compression``, ``s4r_window`` and ``s4r_per_head_bases``
    its ``s4r``'s (``window``, ``per_head_bases``).
    """

    selector: str = _DEFAULTS["selector"]
    budget: float = _DEFAULTS["budget"]
    sink_pages: int = _DEFAULTS["sink_pages"]
    window_pages: int = _DEFAULTS["window_pages"]
    combine: str = _DEFAULTS["combine"]  # "share_avg", "nrm" or "max"
    int8_query: bool = _DEFAULTS["int8_query"]
    epsilon: float = _DEFAULTS["epsilon"]  # locks_certified
    compression: float = _DEFAULTS["compression"]  # s4r
    s4r_window: int = _DEFAULTS["s4r_window"]
    s4r_per_head_bases: bool = _DEFAULTS["s4r_per_head_bases"]
    device: int = _DEFAULTS["device"]  # -1: select on the CPU

    def as_kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _policy(policy: Optional[SelectorPolicy], kwargs: dict[str, Any]) -> SelectorPolicy:
    if policy is None:
        return SelectorPolicy(**kwargs)
    return dataclasses.replace(policy, **kwargs) if kwargs else policy


@dataclass(frozen=True)
class SelectionStats:
    """Telemetry of one selection (``kvsift_selection_stats``)."""

    pairs: int
    pages_chosen: int
    pages_stored: int
    index_bytes_read: int
    kv_bytes_read: int  # 0 after Cache.select: nothing was attended
    kept_estimate: float  # mean over pairs; NaN where the selector makes no estimate
    dropped_bound: float  # max over pairs; NaN where nothing is proven


@dataclass(frozen=True)
class CacheStats:
    """``kvsift_cache_stats``: pool occupancy and what the last attention call read."""

    pages_capacity: int
    pages_in_use: int
    pages_high_water: int
    page_bytes: int
    bytes_in_use: int
    bytes_reserved: int
    n_sequences: int
    last_pages_read: int
    last_tokens_read: int
    last_bytes_read: int
    selector_bytes_held: int
    last_h2d_bytes: int
    last_cache_hits: int
    last_cache_misses: int


@dataclass(frozen=True)
class Selection:
    """What the selector chose for one layer and batch (:meth:`Cache.select`).

    Per (sequence, KV head) pair, sequence-major (pair ``i * n_kv_heads + h``), in compressed rows:
    the pages of pair p are ``page_ids[page_offsets[p]:page_offsets[p + 1]]`` (logical page ids,
    ascending; page j holds tokens ``[j * page_tokens, (j + 1) * page_tokens)``), and the single
    tokens the token-level selectors (louver, s4r) attend besides their pages are
    ``token_positions[token_offsets[p]:token_offsets[p + 1]]`` (ascending). ``kept_estimate`` and
    ``dropped_bound`` are per pair (NaN where the selector makes no estimate or proves nothing).
    """

    n_seqs: int
    n_kv_heads: int
    page_offsets: np.ndarray  # uint32 [pairs + 1]
    page_ids: np.ndarray  # uint32
    token_offsets: np.ndarray  # uint32 [pairs + 1]
    token_positions: np.ndarray  # uint32
    kept_estimate: np.ndarray  # float32 [pairs]
    dropped_bound: np.ndarray  # float32 [pairs]
    stats: SelectionStats = field(repr=False)

    @property
    def n_pairs(self) -> int:
        return self.n_seqs * self.n_kv_heads

    def pages(self, seq_index: int, kv_head: int) -> np.ndarray:
        """The page ids of one pair (a view)."""
        p = self._pair(seq_index, kv_head)
        return self.page_ids[self.page_offsets[p] : self.page_offsets[p + 1]]

    def tokens(self, seq_index: int, kv_head: int) -> np.ndarray:
        """The single token positions of one pair (a view; empty for page-level selectors)."""
        p = self._pair(seq_index, kv_head)
        return self.token_positions[self.token_offsets[p] : self.token_offsets[p + 1]]

    def page_list(self) -> Tuple[np.ndarray, np.ndarray]:
        """``(offsets, page_ids)``, the ``pages`` argument of :meth:`Cache.attend`."""
        return self.page_offsets, self.page_ids

    def padded(self, fill: int = -1) -> np.ndarray:
        """Page ids as int32 ``[n_seqs, n_kv_heads, max_selected]``, padded with ``fill``: the
        dense layout engines such as SGLang pass to their paged kernels."""
        counts = np.diff(self.page_offsets.astype(np.int64))
        width = int(counts.max()) if counts.size else 0
        out = np.full((self.n_pairs, width), fill, dtype=np.int32)
        for p, n in enumerate(counts):
            out[p, :n] = self.page_ids[self.page_offsets[p] : self.page_offsets[p + 1]]
        return out.reshape(self.n_seqs, self.n_kv_heads, width)

    def _pair(self, seq_index: int, kv_head: int) -> int:
        if not (0 <= seq_index < self.n_seqs and 0 <= kv_head < self.n_kv_heads):
            raise IndexError(f"pair ({seq_index}, {kv_head}) is outside "
                             f"({self.n_seqs}, {self.n_kv_heads})")
        return seq_index * self.n_kv_heads + kv_head


class Cache(_core.Cache):
    """A paged host KV cache (``kvsift_cache``).

    Keyword arguments are ``kvsift_cache_params``' fields with its defaults: ``n_layers``,
    ``n_kv_heads``, ``group_size`` (query heads per KV head), ``head_dim`` (64, 128 or 256),
    ``page_tokens`` (16, 32 or 64), ``dtype`` ("f16", "bf16" or "q8"), ``key_form`` ("post_rope" or
    "pre_rope"), ``rope_theta``, ``max_pages``, ``pinned``, ``max_batch``, ``n_threads`` (0: the
    CPUs of the affinity mask), ``isa`` ("auto", "scalar", "avx2", "avx512", "avx512_vnni"),
    ``device`` (-1: CPU) and ``device_cache_pages``.

    Arrays are numpy or any DLPack producer on the CPU (a CPU torch tensor), read in place when
    float32 and C-contiguous (other dtypes and layouts are converted by a copy); results are new
    numpy arrays, or the ``out`` array given, which must be float32 and C-contiguous. Shapes:
    keys and values ``[n_tokens, n_kv_heads, head_dim]``, queries and outputs
    ``[n_seqs, n_kv_heads * group_size, head_dim]`` (a flat last axis is accepted too). Calls
    release the GIL; one handle serves one call at a time (others wait). Use it as a context
    manager, or :meth:`close`, to free its memory at once.
    """

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_selector(self, policy: Optional[SelectorPolicy] = None, **kwargs: Any) -> None:
        """Makes :meth:`attend_selected` and :meth:`select` use a policy: a
        :class:`SelectorPolicy`, keyword arguments (``set_selector(selector="locks",
        budget=0.05)``), or a policy with keyword overrides."""
        self._set_selector(**_policy(policy, kwargs).as_kwargs())

    def attend_selected(self, layer: int, seq_ids: Sequence[int], q: Any,
                        out: Optional[np.ndarray] = None) -> Tuple[np.ndarray, SelectionStats]:
        """Selection, then exact attention over what was chosen; returns (out, stats)."""
        result, stats = self._attend_selected(layer, list(seq_ids), q, out)
        return result, SelectionStats(**stats)

    def select(self, layer: int, seq_ids: Sequence[int], q: Any) -> Selection:
        """Selection without attention (``kvsift_select``), for an engine with its own kernel.

        A call is a selection step for the stateful selectors (s4r, louver), as
        :meth:`attend_selected` is: per layer and step call one of the two.
        """
        ids = list(seq_ids)
        d = self._select(layer, ids, q)
        stats = SelectionStats(**d.pop("stats"))
        return Selection(n_seqs=len(ids), n_kv_heads=self.n_kv_heads, stats=stats, **d)

    def stats(self) -> CacheStats:
        """The pool's occupancy and what the last attention call read."""
        return CacheStats(**self._stats())
