"""Seeded model building that leaves the caller's global RNG untouched."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Run the body with torch's CPU RNG seeded to ``seed``, then restore the previous state.

    Builders use this so that ``get_model(name, seed=0)`` is reproducible without resetting the RNG
    of the test or script that called it. ``None`` leaves the RNG alone (plain ``nn.Module`` init).
    """
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
