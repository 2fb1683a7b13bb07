"""Denormal floats flushed to zero while a compiled partition runs on the calling thread.

A float32 below 1.2e-38 (a denormal) is zero on every int8 grid, yet x86 CPUs compute with one
many times slower than with a normal number. Softmax over attention scores makes millions of
them (the exp of scores far below their row's maximum): ONNX Runtime's Softmax on MiniLM's
[8, 12, 128, 128] scores takes 12.5 ms with them and 0.9 ms with them flushed, and qplug's static
all-MiniLM-L6-v2 session 111.5 -> 67.7 ms with bit-identical embeddings (Intel Xeon, 1 thread).

Runtimes switch this on for their own worker threads (ORT's ``session.set_denormal_as_zero``,
OpenVINO's denormals optimization), but the calling thread, which does all the work at one
thread and a share of it at more, belongs to the caller: :func:`call_flushing_denormals` sets
flush-to-zero there for one call and restores the caller's mode after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["call_flushing_denormals", "denormals_flushed"]

_TINY, _ONE = 5e-324, 1.0  # the smallest double denormal: any SSE product with it flushes to 0


def denormals_flushed() -> bool:
    """Whether this thread flushes denormals to zero now (flush-to-zero or denormals-are-zero:
    either makes a product with a denormal 0; ~60 ns, no torch call)."""
    return _TINY * _ONE == 0.0


def call_flushing_denormals(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with denormals flushed to zero on this thread, then the caller's mode again
    (a thread already flushing is left alone; a CPU without the switch runs ``fn`` as it is)."""
    if denormals_flushed():
        return fn(*args)
    torch.set_flush_denormal(True)
    try:
        return fn(*args)
    finally:
        torch.set_flush_denormal(False)
