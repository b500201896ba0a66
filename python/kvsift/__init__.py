"""kvsift from Python: sparse decode attention over a paged KV cache in host memory.

- :class:`Cache`: the paged cache; append K/V, exact attention (:meth:`Cache.attend`), a
  selector's choice with attention (:meth:`Cache.attend_selected`) or without
  (:meth:`Cache.select`, for engines with their own paged kernel).
- :class:`SelectorPolicy`: dense, oracle, quest, locks, locks_certified, s4r, louver.
- :class:`Model`: a Llama-family GGUF model (tokenize, chat template, prefill, decode,
  :meth:`Model.generate`), and :class:`Sampler`.
- Errors: every failed call raises a :class:`KvsiftError` subclass carrying its status.

The package wraps the C API of ``include/kvsift/kvsift.h``; the README and that header document
the methods and every parameter.
"""

from __future__ import annotations

from typing import Callable, Optional

from . import _core
from .cache import Cache, CacheStats, Selection, SelectionStats, SelectorPolicy
from .errors import (
    BufferTooSmallError,
    CapacityExceededError,
    FileReadError,
    InternalError,
    InvalidArgumentError,
    InvalidFileError,
    KvsiftError,
    NotFoundError,
    OutOfMemoryError,
    Status,
    UnsupportedError,
    error_for,
)
from .model import Model, ModelInfo, ModelStats, Sampler

_core._set_error_factory(error_for)

__version__: str = _core.version()
#: The selectors' names, in the C enum's order.
SELECTORS: tuple[str, ...] = tuple(_core.selector_names())


def isa_supported() -> str:
    """The best ISA level this CPU supports: "scalar", "avx2", "avx512" or "avx512_vnni"."""
    return _core.isa_supported()


def set_max_isa(isa: str) -> None:
    """Caps the ISA of handles created afterwards ("auto" removes the cap)."""
    _core.set_max_isa(isa)


def gpu_device_count() -> int:
    """Usable CUDA devices; raises :class:`UnsupportedError` without CUDA or a device."""
    return _core.gpu_device_count()


def gpu_memory_info(device: int = 0) -> tuple[int, int]:
    """``(used_bytes, total_bytes)`` of a CUDA device; used counts every process on it. Raises
    :class:`UnsupportedError` without CUDA or a device, :class:`InvalidArgumentError` for a device
    outside the count."""
    return _core.gpu_memory_info(device)


def set_log_callback(fn: Optional[Callable[[int, str], None]], min_level: int = 1) -> None:
    """``fn(level, message)`` receives kvsift's log lines at ``min_level`` and above (0 debug,
    1 info, 2 warn, 3 error); None silences kvsift again. Set it once, before creating handles."""
    _core.set_log_callback(fn, min_level)


__all__ = [
    "SELECTORS",
    "BufferTooSmallError",
    "Cache",
    "CacheStats",
    "CapacityExceededError",
    "FileReadError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidFileError",
    "KvsiftError",
    "Model",
    "ModelInfo",
    "ModelStats",
    "NotFoundError",
    "OutOfMemoryError",
    "Sampler",
    "Selection",
    "SelectionStats",
    "SelectorPolicy",
    "Status",
    "UnsupportedError",
    "gpu_device_count",
    "gpu_memory_info",
    "isa_supported",
    "set_log_callback",
    "set_max_isa",
]
