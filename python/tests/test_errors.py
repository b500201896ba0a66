"""Every status becomes its exception, carrying the status and the C API's message; bad input
never crashes."""

from __future__ import annotations

import numpy as np
import pytest

import kvsift
from kvsift import Status

GEOMETRY = dict(n_layers=1, n_kv_heads=2, group_size=2, head_dim=64, page_tokens=16)


def raises(cls, status, needle=""):
    """pytest.raises for a kvsift error that also checks its status and message."""

    class Check:
        def __enter__(self):
            self.ctx = pytest.raises(cls)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self.ctx.__exit__(*exc)
            if not suppressed:
                return False
            e = self.info.value
            assert isinstance(e, kvsift.KvsiftError)
            assert e.status == status
            assert needle in e.message, (needle, e.message)
            assert str(e).startswith(status.name.lower().replace("_", " "))
            return suppressed

    return Check()


def test_each_status_maps_to_its_class_and_builtin_base():
    expected = {
        Status.INVALID_ARGUMENT: (kvsift.InvalidArgumentError, ValueError),
        Status.UNSUPPORTED: (kvsift.UnsupportedError, NotImplementedError),
        Status.OUT_OF_MEMORY: (kvsift.OutOfMemoryError, MemoryError),
        Status.CAPACITY_EXCEEDED: (kvsift.CapacityExceededError, kvsift.KvsiftError),
        Status.NOT_FOUND: (kvsift.NotFoundError, LookupError),
        Status.IO_ERROR: (kvsift.FileReadError, OSError),
        Status.INVALID_FILE: (kvsift.InvalidFileError, kvsift.KvsiftError),
        Status.INTERNAL: (kvsift.InternalError, kvsift.KvsiftError),
        Status.BUFFER_TOO_SMALL: (kvsift.BufferTooSmallError, kvsift.KvsiftError),
    }
    assert set(expected) == set(Status) - {Status.OK}
    for status, (cls, base) in expected.items():
        e = kvsift.error_for(int(status), "why")
        assert type(e) is cls and isinstance(e, base) and e.status == status
        assert e.message == "why"
    assert type(kvsift.error_for(77, "?")) is kvsift.InternalError


def test_invalid_arguments_from_the_library_and_from_array_shapes():
    with kvsift.Cache(**GEOMETRY) as cache:
        s = cache.create_sequence()
        k = np.zeros((3, 2, 64), dtype=np.float32)
        with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT, "layer"):
            cache.append(s, 5, k, k)
        with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT, "expected (3, 2, 64)"):
            cache.append(s, 0, k, np.zeros((3, 2, 32), dtype=np.float32))
        bad = k.copy()
        bad[1, 1, 7] = np.nan
        with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT):
            cache.append(s, 0, bad, k)
        assert cache.sequence_length(s, 0) == 0  # a refused append changed nothing
        cache.append(s, 0, k, k)
        q = np.zeros((1, 4, 64), dtype=np.float32)
        q[0, 0, 0] = np.inf
        with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT, "q"):
            cache.attend(0, [s], q)
        with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT, "q"):
            cache.select(0, [s], q)
        with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT, "expected (1, 4, 64)"):
            cache.attend(0, [s], np.zeros((2, 4, 64), dtype=np.float32))
        with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT, "budget"):
            cache.set_selector(selector="locks", budget=-1.0)
        with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT, "dtype"):
            kvsift.Cache(**GEOMETRY, dtype="f8")
        with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT, "n_layers"):
            kvsift.Cache(n_layers=0)
        with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT, "beyond"):
            cache.attend(0, [s], np.zeros((1, 4, 64), dtype=np.float32),
                         pages=(np.array([0, 1, 9], dtype=np.uint32),
                                np.array([0], dtype=np.uint32)))
    cache.close()  # twice is fine
    with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT, "closed"):
        cache.create_sequence()


def test_unsupported_requests():
    with raises(kvsift.UnsupportedError, Status.UNSUPPORTED, "head_dim"):
        kvsift.Cache(head_dim=96)
    try:
        n = kvsift.gpu_device_count()
    except kvsift.UnsupportedError as e:
        assert e.status == Status.UNSUPPORTED
        with raises(kvsift.UnsupportedError, Status.UNSUPPORTED, "kvsift_gpu_memory_info"):
            kvsift.gpu_memory_info(0)
    else:
        assert n >= 0
        used, total = kvsift.gpu_memory_info(0)
        assert 0 < used <= total
        with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT, "device"):
            kvsift.gpu_memory_info(n)


def test_not_found():
    with kvsift.Cache(**GEOMETRY) as cache:
        with raises(kvsift.NotFoundError, Status.NOT_FOUND, "7"):
            cache.free_sequence(7)
        with raises(kvsift.NotFoundError, Status.NOT_FOUND, "available"):
            cache.set_selector(selector="psychic")


def test_capacity_exceeded_leaves_the_cache_as_it_was():
    with kvsift.Cache(**GEOMETRY, max_pages=4) as cache:
        s = cache.create_sequence()
        k = np.ones((40, 2, 64), dtype=np.float32)  # 3 pages per KV head: 6 > 4
        with raises(kvsift.CapacityExceededError, Status.CAPACITY_EXCEEDED):
            cache.append(s, 0, k, k)
        assert cache.sequence_length(s, 0) == 0
        assert cache.stats().pages_in_use == 0


def test_out_of_memory_when_the_pool_cannot_be_reserved():
    # 2^32 - 1 pages of 64 KiB: 256 TiB, beyond the 128 TiB of a user address space.
    with raises(kvsift.OutOfMemoryError, Status.OUT_OF_MEMORY):
        kvsift.Cache(head_dim=256, page_tokens=64, max_pages=(1 << 32) - 1)


def test_files_that_cannot_be_read_or_parsed(tmp_path):
    with raises(kvsift.FileReadError, Status.IO_ERROR):
        kvsift.Model(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(60))
    with raises(kvsift.InvalidFileError, Status.INVALID_FILE):
        kvsift.Model(str(junk))


def test_sampler_refusals():
    sampler = kvsift.Sampler()
    with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT):
        sampler.sample(np.full(4, -np.inf, dtype=np.float32))
    with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT):
        sampler.sample(np.array([0.0, np.nan], dtype=np.float32))
    with raises(kvsift.InvalidArgumentError, Status.INVALID_ARGUMENT, "top_p"):
        kvsift.Sampler(top_p=0.0)
    assert sampler.sample(np.array([0.0, 3.0, 1.0], dtype=np.float32)) == 1


def test_wrong_dtypes_and_non_arrays_raise_type_errors_not_crashes():
    with kvsift.Cache(**GEOMETRY) as cache:
        s = cache.create_sequence()
        with pytest.raises(TypeError):
            cache.append(s, 0, "not an array", None)
        with pytest.raises(TypeError):
            cache.attend(0, [s], object())
