"""Statuses and the exceptions they become.

Every kvsift call that fails raises a subclass of :class:`KvsiftError` carrying the C API's
status (:class:`Status`) and its message (``kvsift_last_error()``). Each subclass also derives
from the built-in exception a Python caller would expect (``ValueError`` for an invalid argument,
``MemoryError``, ``LookupError``, ``OSError``), so ordinary ``except`` clauses work too.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """``kvsift_status``: the C API's result codes."""

    OK = 0
    INVALID_ARGUMENT = 1
    UNSUPPORTED = 2
    OUT_OF_MEMORY = 3
    CAPACITY_EXCEEDED = 4
    NOT_FOUND = 5
    IO_ERROR = 6
    INVALID_FILE = 7
    INTERNAL = 8
    BUFFER_TOO_SMALL = 9


class KvsiftError(Exception):
    """A kvsift call failed. ``status`` is its :class:`Status`, ``message`` what went wrong."""

    status: Status = Status.INTERNAL

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = Status(status)
        self.message = message

    def __str__(self) -> str:
        return f"{self.status.name.lower().replace('_', ' ')}: {self.message}"


class InvalidArgumentError(KvsiftError, ValueError):
    """A NULL, zero, mismatched, out-of-range or non-finite argument (or a wrong array shape)."""


class UnsupportedError(KvsiftError, NotImplementedError):
    """A valid request this build or machine cannot serve (CUDA, an ISA, a model kind)."""


class OutOfMemoryError(KvsiftError, MemoryError):
    """The system refused an allocation."""


class CapacityExceededError(KvsiftError):
    """The cache's page capacity (or the model's context) would be exceeded."""


class NotFoundError(KvsiftError, LookupError):
    """An unknown sequence id, selector name or other named object."""


class FileReadError(KvsiftError, OSError):
    """A file could not be read (``KVSIFT_STATUS_IO_ERROR``)."""


class InvalidFileError(KvsiftError):
    """A file's content is malformed or out of bounds."""


class InternalError(KvsiftError):
    """A bug in kvsift: please report the message."""


class BufferTooSmallError(KvsiftError):
    """An output buffer was too small (the package sizes its own buffers, so rarely seen)."""


_BY_STATUS: dict[Status, type[KvsiftError]] = {
    Status.INVALID_ARGUMENT: InvalidArgumentError,
    Status.UNSUPPORTED: UnsupportedError,
    Status.OUT_OF_MEMORY: OutOfMemoryError,
    Status.CAPACITY_EXCEEDED: CapacityExceededError,
    Status.NOT_FOUND: NotFoundError,
    Status.IO_ERROR: FileReadError,
    Status.INVALID_FILE: InvalidFileError,
    Status.INTERNAL: InternalError,
    Status.BUFFER_TOO_SMALL: BufferTooSmallError,
}
for _status, _cls in _BY_STATUS.items():
    _cls.status = _status


def error_class(status: int) -> type[KvsiftError]:
    """The exception class a status becomes (:class:`InternalError` for an unknown one)."""
    try:
        return _BY_STATUS[Status(status)]
    except ValueError:
        return InternalError


def error_for(status: int, message: str) -> KvsiftError:
    """The exception for a failed call (the extension module raises what this returns)."""
    cls = error_class(status)
    known = status in Status.__members__.values()
    return cls(status if known else Status.INTERNAL, message)
