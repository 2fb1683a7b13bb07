"""Whether a small per-call kernel runs faster on the calling thread alone, measured once.

At decode (one token), each linear is one short kernel call (~50 us at 1024 x 1024 int8). With
more than one intra-op thread, every call is also a fork/join of the OpenMP team; when the other
threads are not running (a CPU shared with other work), each call waits for the scheduler to wake
them. Measured in a Llama decoder on a 2-core AMD EPYC Zen 4 at load ~7: oneDNN's one-token int8
linear took 6-20 ms per call at 2 threads against ~0.05 ms at 1, while fp32's matmuls lost only
2x (``bench/bench_llm.py``). Where the machine is quiet and the weights large, more threads win;
so the choice is measured per (kernel, shape, thread count), interleaving the two settings, and
kept for the process. Only the thread count of the call changes (``torch.set_num_threads`` for
its duration, restored after).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

_RUNS = 3
_cache: dict[tuple[Hashable, int], bool] = {}
_lock = threading.Lock()
T = TypeVar("T")


def run_with_fastest_threads(key: Hashable, call: Callable[[], T]) -> T:
    """``call()``, on one thread when that measured faster than ``torch.get_num_threads()``
    threads for ``key`` (measured on the first calls, with ``call`` itself)."""
    threads = torch.get_num_threads()
    if threads == 1:
        return call()
    single = _cache.get((key, threads))
    if single is None:
        single = _measure(call, threads)
        with _lock:
            _cache[(key, threads)] = single
    if not single:
        return call()
    torch.set_num_threads(1)
    try:
        return call()
    finally:
        torch.set_num_threads(threads)


def _measure(call: Callable[[], object], threads: int) -> bool:
    """Best of a few runs at 1 thread and at ``threads`` threads, interleaved; True if 1 is faster."""
    best = {1: float("inf"), threads: float("inf")}
    try:
        for _ in range(_RUNS + 1):  # the first round warms both settings up
            for count in (1, threads):
                torch.set_num_threads(count)
                start = time.perf_counter()
                call()
                best[count] = min(best[count], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best[1] < best[threads]


def single_thread_choices() -> dict[tuple[Hashable, int], bool]:
    """What was measured: (key, thread count) -> whether one thread runs it."""
    with _lock:
        return dict(_cache)


def clear() -> None:
    """Forget the measurements (tests; a process whose CPU share changed)."""
    with _lock:
        _cache.clear()
