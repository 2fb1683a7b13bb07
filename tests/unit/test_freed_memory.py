"""Returning freed heap pages: glibc's ``malloc_trim`` where the C library has it, nothing elsewhere."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from qplug_core.flows import freed_memory


@pytest.fixture
def fresh_lookup():
    freed_memory._malloc_trim.cache_clear()
    yield
    freed_memory._malloc_trim.cache_clear()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_glibc_frees_pages_and_keeps_live_tensors(fresh_lookup):
    assert freed_memory._malloc_trim() is not None
    kept = torch.arange(1 << 20, dtype=torch.float32)
    freed = [torch.ones(1 << 18) for _ in range(8)]
    del freed
    freed_memory.give_back_freed_memory()
    assert torch.equal(kept, torch.arange(1 << 20, dtype=torch.float32))


class _LibcWithoutTrim:
    def __init__(self, name: object) -> None:
        pass


@pytest.mark.parametrize("library", [_LibcWithoutTrim, None], ids=["no malloc_trim", "no C library handle"])
def test_without_malloc_trim_nothing_is_done(fresh_lookup, monkeypatch: pytest.MonkeyPatch, library):
    def no_handle(name: object) -> None:
        raise OSError("no handle for the process")

    monkeypatch.setattr(ctypes, "CDLL", library or no_handle)
    assert freed_memory._malloc_trim() is None
    freed_memory.give_back_freed_memory()  # musl, macOS, Windows: returns without raising
