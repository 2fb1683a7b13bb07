"""Hand the memory a step of the flow freed back to the system, where glibc would keep it.

glibc's malloc keeps freed blocks below its mmap threshold (which rises to 32 MiB as large
tensors are freed: every BERT-base weight but the embedding) in its heap, resident once touched.
The next step's temporaries land in those holes here and there and touch their pages again, so
the process's resident size, what a machine with little RAM runs out of, stayed at the flow's
highest heap: a converted model's rounded float weights (freed as its layers are lowered) and
then a target search's layer errors and scores kept config-built BERT-base's ``qp.quantize`` near
3.2x its float bytes over the process's start. ``malloc_trim`` returns the free pages (it keeps
the blocks: nothing is moved). Where the C library has none (musl, macOS, Windows), nothing is
done: those allocators return memory by their own rules.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the process's C library has none."""
    try:
        libc = ctypes.CDLL(None)  # the symbols the process already has: its own C library
    except (OSError, TypeError):  # Windows: no handle for the process itself
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def give_back_freed_memory() -> None:
    """Return the free pages of the C heap to the system (glibc only; see the module's docstring)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


__all__ = ["give_back_freed_memory"]
