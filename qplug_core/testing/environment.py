"""Test-environment helpers for qplug's suites and for third-party plugin authors' tests."""

from __future__ import annotations

import contextlib
import importlib.metadata
from typing import Iterator

import pytest
import torch

from qplug_core.registry import plugins

_SWITCHES = (plugins.ENV_LOAD, plugins.ENV_DISABLE, plugins.ENV_STRICT)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread: small models run faster and steadier on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def all_plugins_loaded() -> Iterator[None]:
    """Every installed ``qplug`` plugin loaded (no QPLUG_* switch set), on a fresh manager."""
    with pytest.MonkeyPatch.context() as mp:
        for name in _SWITCHES:
            mp.delenv(name, raising=False)
        plugins.reset()
        try:
            yield
        finally:
            plugins.reset()


def require_distribution(distribution: str) -> None:
    """Skip the calling test module unless ``distribution`` is installed."""
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{distribution} is not installed (pip install it to run these tests)",
                    allow_module_level=True)


__all__ = ["all_plugins_loaded", "one_thread", "require_distribution"]
