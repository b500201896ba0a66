"""kvsift under Hugging Face transformers: a KV cache in kvsift and decode attention through it.

    import kvsift.transformers as kt
    model = kt.enable(AutoModelForCausalLM.from_pretrained(...))   # attention "kvsift"
    cache = kt.KvsiftCache(model.config, selector="locks", budget=0.05)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64, do_sample=False)

:class:`KvsiftCache` is a ``transformers.Cache`` whose K/V live in one :class:`kvsift.Cache`
(one kvsift layer per model layer, fp16 pages in host memory, keys post-RoPE as the model hands
them to its cache). :func:`enable` registers the attention function ``"kvsift"`` (transformers'
``AttentionInterface``) and switches the model to it:

- a chunk of several tokens (the prompt) is appended to the kvsift cache and attends through
  transformers' own SDPA attention over its K/V (a later chunk also over the earlier tokens,
  read back from the cache): prompt processing stays dense;
- a single-token step (decode) appends the token's K/V and attends through kvsift:
  ``Cache.attend_selected`` with the cache's selector policy (dense: exact attention over every
  token; otherwise the chosen pages or tokens).

Tensors cross to kvsift as CPU float32 tensors through DLPack, read in place where the layout
allows; kvsift writes its output into a CPU tensor, which is returned as it is on a CPU model.
On a CUDA model each layer's new K/V, the query and the output cross the PCIe link at every step
(kvsift's cache and attention stay in host memory).

Not supported (each raises :class:`kvsift.UnsupportedError`): padded batches (kvsift sequences
hold every token they are given), cropping and beam search. S4R needs keys before RoPE, which
transformers does not hand to a cache: ``set_selector`` refuses it on this post-RoPE cache.
Needs torch and transformers 5 (``pip install torch transformers``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache as _HFCache
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache import Cache, SelectionStats, SelectorPolicy
from .errors import Status, UnsupportedError

#: The attention implementation's name in transformers' registries.
ATTENTION = "kvsift"

# Set on the key tensor KvsiftCache.update returns, so that the attention function finds the
# cache and layer the model's attention module handed them to (transformers passes the attention
# function the tensors update returned, not the cache).
_TAG = "_kvsift_layer"


def _unsupported(message: str) -> UnsupportedError:
    return UnsupportedError(Status.UNSUPPORTED, message)


class KvsiftLayer(CacheLayerMixin):
    """One model layer of a :class:`KvsiftCache`: its K/V are kvsift layer ``index``'s."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: "KvsiftCache", index: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index
        self.length = 0  # tokens appended to this layer, the same for every sequence

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise _unsupported("beam search: a kvsift sequence cannot be reordered in place")

    def crop(self, tokens_to_remove: int) -> None:
        raise _unsupported("cropping: kvsift appends are final")

    def offload(self) -> None:  # the K/V are in host memory already
        pass

    def prefetch(self) -> None:
        pass


class KvsiftCache(_HFCache):
    """A ``transformers.Cache`` holding the model's K/V in a :class:`kvsift.Cache`.

    ``config`` is the model's config (layers, heads, head_dim). The selector policy is a
    :class:`kvsift.SelectorPolicy` and/or its keywords (``selector="locks", budget=0.05``;
    dense by default); :meth:`set_selector` changes it between generations. ``cache_params``
    go to :class:`kvsift.Cache` (``page_tokens``, ``max_pages``, ``n_threads``, ``isa``,
    ``max_batch``, ``dtype``). Batch row ``i`` is kvsift sequence ``seq_ids[i]``, created at the
    first update. Use one cache per generation, or :meth:`reset` it (or use it as a context
    manager, or :meth:`close`, to free its memory at once).
    """

    def __init__(self, config: Any, policy: Optional[SelectorPolicy] = None, *,
                 cache_params: Optional[dict[str, Any]] = None, **policy_kwargs: Any) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n_layers = int(text.num_hidden_layers)
        n_heads = int(text.num_attention_heads)
        n_kv_heads = int(getattr(text, "num_key_value_heads", None) or n_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // n_heads)
        layer_types = getattr(text, "layer_types", None) or []
        if getattr(text, "sliding_window", None) or any(t != "full_attention" for t in layer_types):
            raise _unsupported("sliding-window or hybrid layers: kvsift attends full layers")
        self.kv = Cache(n_layers=n_layers, n_kv_heads=n_kv_heads, group_size=n_heads // n_kv_heads,
                        head_dim=head_dim, key_form="post_rope", **(cache_params or {}))
        self.n_kv_heads, self.n_heads, self.head_dim = n_kv_heads, n_heads, head_dim
        self.seq_ids: list[int] = []
        self.last_stats: Optional[SelectionStats] = None  # the last decode step's (last layer)
        super().__init__(layers=[KvsiftLayer(self, i) for i in range(n_layers)])
        try:
            self.set_selector(policy, **policy_kwargs)
        except BaseException:
            self.kv.close()
            raise

    # ---- kvsift side ----------------------------------------------------------------------------

    def set_selector(self, policy: Optional[SelectorPolicy] = None, **kwargs: Any) -> None:
        """The selector policy of later decode steps (:meth:`kvsift.Cache.set_selector`)."""
        self.kv.set_selector(policy, **kwargs)

    def close(self) -> None:
        self.kv.close()

    def __enter__(self) -> "KvsiftCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sequences(self, batch: int) -> list[int]:
        if not self.seq_ids:
            self.seq_ids = [self.kv.create_sequence() for _ in range(batch)]
        elif batch != len(self.seq_ids):
            raise _unsupported(f"a batch of {batch} rows in a cache of {len(self.seq_ids)} "
                               "sequences")
        return self.seq_ids

    def _update(self, layer: KvsiftLayer, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends ``k, v`` ([batch, n_kv_heads, n, head_dim], post-RoPE) to kvsift and returns
        what the attention function needs: the new K/V for a decode step or a first chunk, every
        token's K/V for a later chunk (the earlier ones as stored, rounded to fp16)."""
        batch, _, n, _ = k.shape
        seqs = self._sequences(batch)
        past = layer.length
        # [batch, n_kv_heads, n, d] -> [batch, n, n_kv_heads, d], float32 on the CPU: the
        # layout kvsift.Cache.append reads in place (one copy on a CPU model; on a GPU the
        # transpose is made there and the copy to the host converts the dtype on the way).
        kt = k.transpose(1, 2).contiguous().to("cpu", torch.float32)
        vt = v.transpose(1, 2).contiguous().to("cpu", torch.float32)
        for b, seq in enumerate(seqs):
            self.kv.append(seq, layer.index, kt[b], vt[b])
        layer.length += n
        if n > 1 and past > 0:
            k, v = self._with_past(layer.index, past, k, v)
        k = k.view_as(k)  # a new tensor object to tag; the caller's stays untagged
        setattr(k, _TAG, (self, layer.index))
        return k, v

    def _with_past(self, layer: int, past: int, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = [], []
        for seq in self.seq_ids:
            rows = [self.kv.read_tokens(seq, layer, h, 0, past) for h in range(self.n_kv_heads)]
            ks.append(torch.stack([torch.from_numpy(r[0]) for r in rows]))
            vs.append(torch.stack([torch.from_numpy(r[1]) for r in rows]))
        pk = torch.stack(ks).to(k.device, k.dtype)
        pv = torch.stack(vs).to(v.device, v.dtype)
        return torch.cat([pk, k], dim=-2), torch.cat([pv, v], dim=-2)

    def _decode(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """kvsift attention for one query token per sequence: ``query`` [batch, n_heads, 1, d];
        returns [batch, 1, n_heads, d] on the query's device and dtype."""
        q = query[:, :, 0, :]
        scale = scaling * self.head_dim ** 0.5  # kvsift scales by 1/sqrt(head_dim)
        if abs(scale - 1.0) > 1e-6:
            q = q * scale
        q = q.to("cpu", torch.float32).contiguous()
        out = torch.empty_like(q)
        _, self.last_stats = self.kv.attend_selected(layer, self.seq_ids, q, out=out)
        return out.to(query.device, query.dtype).unsqueeze(1)

    # ---- transformers side ----------------------------------------------------------------------

    def reset(self) -> None:
        """Frees the sequences (their pages go back to the pool) for a new generation."""
        for seq in self.seq_ids:
            self.kv.free_sequence(seq)
        self.seq_ids = []
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each sequence followed by ``repeats - 1`` forks of it (sharing its sealed pages)."""
        if not self.seq_ids:
            return
        self.seq_ids = [s for seq in self.seq_ids
                        for s in [seq] + [self.kv.fork(seq) for _ in range(repeats - 1)]]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        keep = [self.seq_ids[int(i)] for i in indices.tolist()]
        for seq in set(self.seq_ids) - set(keep):
            self.kv.free_sequence(seq)
        self.seq_ids = keep


def _padded(mask: Optional[torch.Tensor]) -> bool:
    """Whether a 4D attention mask hides some earlier token from the chunk's last query: with
    the sdpa mask function a plain causal mask is None or has a full last row."""
    if mask is None:
        return False
    last = mask[..., -1, :]
    return not bool(last.all() if last.dtype == torch.bool else (last == 0).all())


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
              dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"kvsift"`` attention function (transformers' attention-function signature)."""
    tag = getattr(key, _TAG, None)
    if tag is None:
        raise _unsupported(f'attention "{ATTENTION}" needs past_key_values=KvsiftCache(...) '
                           "(kvsift.transformers.KvsiftCache)")
    if _padded(attention_mask):
        raise _unsupported("padded batches: kvsift sequences hold every token they are given; "
                           "generate unpadded prompts, or one prompt at a time")
    cache, layer = tag
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if query.shape[2] == 1:
        return cache._decode(layer, query, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def register() -> None:
    """Registers ``"kvsift"`` with transformers' attention and mask interfaces (the sdpa mask:
    None for a plain causal chunk, which this attention requires)."""
    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def enable(model: Any) -> Any:
    """Registers the attention function and switches ``model`` to it; returns the model. Pass
    a :class:`KvsiftCache` as ``past_key_values`` to every forward or generate call."""
    register()
    model.set_attn_implementation(ATTENTION)
    return model


__all__ = ["ATTENTION", "KvsiftCache", "KvsiftLayer", "attention", "enable", "register"]
