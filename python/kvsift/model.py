"""The model runner: a Llama-family GGUF model on the CPU, its KV cache in kvsift's cache."""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core
from .cache import SelectorPolicy, _policy

Message = Union[Mapping[str, str], Tuple[str, str]]
Prompt = Union[str, Sequence[Message], Sequence[int], np.ndarray]


@dataclass(frozen=True)
class ModelInfo:
    """``kvsift_model_info``: the model's shape and special tokens."""

    n_layers: int
    n_embd: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int  # positions the model was trained for
    n_ctx: int  # positions per sequence in this instance
    bos: int
    eos: int


@dataclass(frozen=True)
class ModelStats:
    """``kvsift_model_stats``: prefill and decode counts and times, KV bytes, the last step."""

    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float
    decode_attention_seconds: float
    kv_bytes_held: int
    last_step_kv_bytes_read: int
    last_step_index_bytes_read: int
    last_step_kept_estimate: float
    last_step_dropped_bound: float
    summary_bytes_per_page: int
    selector_bytes_held: int
    last_step_select_us: float
    last_step_transfer_us: float
    last_step_attend_us: float
    last_step_h2d_bytes: int
    last_step_cache_hits: int
    last_step_cache_misses: int
    last_step_plan_us: float
    last_step_row_h2d_bytes: int
    last_step_rows_equivalent_bytes: int


class Sampler(_core.Sampler):
    """Chooses tokens from logits (``kvsift_sampler``): ``temperature`` 0 is greedy (argmax),
    ``top_p`` in (0, 1] truncates to the nucleus, and the same ``seed`` repeats a run."""


class Model(_core.Model):
    """A GGUF model (``kvsift_model_load``; memory-mapped, weights dequantized at load).

    Keyword arguments are ``kvsift_model_params``' fields with its defaults: ``n_ctx`` (0: the
    model's training context), ``max_seqs`` (sequences per decode step), ``prefill_chunk``,
    ``weights_f32``, ``kv_dtype`` ("f16", "bf16" or "q8"), ``page_tokens``, ``n_threads``,
    ``isa``, ``device``, ``device_cache_pages`` and ``weights`` ("bf16", "f32", or "quantized":
    the linear layers stay in the file's Q8_0/Q4_0/Q4_1 blocks, a fraction of bf16's memory; CPU
    only). Calls release the GIL; one handle serves one call at a time.
    """

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(**self._info())

    def stats(self) -> ModelStats:
        return ModelStats(**self._stats())

    def set_selector(self, policy: Optional[SelectorPolicy] = None, **kwargs: Any) -> None:
        """Makes every later decode step use a policy (:class:`SelectorPolicy` or keywords)."""
        self._set_selector(**_policy(policy, kwargs).as_kwargs())

    def tokenize(self, text: Union[str, bytes], parse_special: bool = False) -> np.ndarray:
        """Token ids (int32) of UTF-8 text; with ``parse_special``, control-token text such as
        ``"<|im_start|>"`` becomes that token."""
        if isinstance(text, str):
            text = text.encode("utf-8")
        return self._tokenize(text, parse_special)

    def detokenize(self, tokens: Union[Sequence[int], np.ndarray]) -> bytes:
        """UTF-8 bytes of token ids (bytes: a token may end inside a multi-byte character)."""
        return self._detokenize(np.ascontiguousarray(tokens, dtype=np.int32))

    def chat_template(self, messages: Sequence[Message], add_assistant: bool = True) -> str:
        """The file's chat template around messages: ``{"role": ..., "content": ...}`` mappings
        or ``(role, content)`` pairs; ``add_assistant`` opens the assistant's turn."""
        pairs = [(m["role"], m["content"]) if isinstance(m, Mapping) else (m[0], m[1])
                 for m in messages]
        return self._chat_template(pairs, add_assistant)

    def prefill(self, seq: int, tokens: Union[Sequence[int], np.ndarray],
                all_logits: bool = False,
                progress: Optional[Callable[[int, int], None]] = None) -> Optional[np.ndarray]:
        """Runs prompt tokens through the model into the sequence. ``progress(done, total)`` is
        called after each chunk (with the GIL; an exception it raises is raised when the prefill
        has finished). With ``all_logits``, returns float32 ``[n_tokens, n_vocab]``."""
        return self._prefill(seq, np.ascontiguousarray(tokens, dtype=np.int32), all_logits,
                             progress)

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> None:
        """One decode step: ``tokens[i]`` for ``seq_ids[i]``."""
        self._decode([int(s) for s in seq_ids], [int(t) for t in tokens])

    def prompt_tokens(self, prompt: Prompt, chat: bool = True) -> np.ndarray:
        """Token ids of a prompt: text (inside the chat template as one user turn when ``chat``),
        a list of chat messages, or token ids as they are."""
        if isinstance(prompt, str):
            if chat:
                return self.tokenize(self.chat_template([("user", prompt)]), parse_special=True)
            return self.tokenize(prompt)
        if isinstance(prompt, np.ndarray) or (len(prompt) > 0 and
                                              isinstance(prompt[0], (int, np.integer))):
            return np.ascontiguousarray(prompt, dtype=np.int32)
        return self.tokenize(self.chat_template(prompt), parse_special=True)  # type: ignore[arg-type]

    def generate_tokens(self, prompt: Prompt, max_new: int = 256,
                        sampler: Optional[Sampler] = None, *, chat: bool = True,
                        stop_at_end: bool = True,
                        progress: Optional[Callable[[int, int], None]] = None) -> Iterator[int]:
        """Yields generated token ids: prefill of the prompt (see :meth:`prompt_tokens`) in a
        new sequence, then up to ``max_new`` decode steps, stopping before an end token when
        ``stop_at_end``. ``sampler`` defaults to greedy. The sequence is freed at the end."""
        sampler = sampler if sampler is not None else Sampler()
        tokens = self.prompt_tokens(prompt, chat)
        seq = self.create_sequence()
        try:
            self.prefill(seq, tokens, progress=progress)
            for _ in range(max_new):
                token = sampler.sample(self.logits(seq))
                if stop_at_end and self.is_end(token):
                    return
                yield token
                self.decode([seq], [token])
        finally:
            self.free_sequence(seq)

    def generate(self, prompt: Prompt, max_new: int = 256, sampler: Optional[Sampler] = None,
                 *, chat: bool = True, stop_at_end: bool = True,
                 progress: Optional[Callable[[int, int], None]] = None) -> Iterator[str]:
        """Yields the generated text as it grows, in complete UTF-8 characters (a token that
        ends inside a character waits for the next one). Arguments as :meth:`generate_tokens`."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        answer: list[int] = []
        emitted = 0
        for token in self.generate_tokens(prompt, max_new, sampler, chat=chat,
                                          stop_at_end=stop_at_end, progress=progress):
            answer.append(token)
            # The whole answer each time, as kvsift-demo prints it: byte-level BPE pieces are not
            # always the bytes of the tokens' texts joined.
            text = self.detokenize(answer)
            piece = decoder.decode(text[emitted:])
            emitted = len(text)
            if piece:
                yield piece
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail
