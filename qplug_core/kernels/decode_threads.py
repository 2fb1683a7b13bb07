"""Whether a small per-call kernel runs faster on the calling thread alone, measured once.

At decode (one token), each linear is one short kernel call (~50 us at 1024 x 1024 int8). With
more than one intra-op thread, every call is also a fork/join of the OpenMP team; when the other
threads are not running (a CPU shared with other work), each call waits for the scheduler to wake
them. Measured in a Llama decoder on a 2-core AMD EPYC Zen 4 at load ~7: oneDNN's one-token int8
linear took 6-20 ms per call at 2 threads against ~0.05 ms at 1, while fp32's matmuls lost only
2x (``bench/bench_llm.py``). Where the machine is quiet and the weights large, more threads win;
so the choice is measured per (kernel, shape, thread count), interleaving the two settings, and
measured again every ``REMEASURE_EVERY`` calls, as the load of a shared machine changes. The
settings are compared by their total time, not their best run: at load ~7 the best of three
2-thread calls hit a moment the worker was running and chose 2 threads, while the typical
2-thread call waited milliseconds (a 4-layer W8A8 decode step 299 ms against 195 ms on one
thread). Only the thread count of the call changes (``torch.set_num_threads`` for its duration,
restored after).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

_RUNS = 3
#: calls of one (key, thread count) between two measurements
REMEASURE_EVERY = 512
_cache: dict[tuple[Hashable, int], bool] = {}
_calls: dict[tuple[Hashable, int], int] = {}
_lock = threading.Lock()
T = TypeVar("T")


def run_with_fastest_threads(key: Hashable, call: Callable[[], T]) -> T:
    """``call()``, on one thread when that measured faster than ``torch.get_num_threads()``
    threads for ``key`` (measured with ``call`` itself on the first call and every
    ``REMEASURE_EVERY`` calls)."""
    threads = torch.get_num_threads()
    if threads == 1:
        return call()
    entry = (key, threads)
    with _lock:
        calls = _calls[entry] = _calls.get(entry, 0) + 1
    single = _cache.get(entry)
    if single is None or calls % REMEASURE_EVERY == 0:
        single = _measure(call, threads)
        with _lock:
            _cache[entry] = single
    if not single:
        return call()
    torch.set_num_threads(1)
    try:
        return call()
    finally:
        torch.set_num_threads(threads)


def _measure(call: Callable[[], object], threads: int) -> bool:
    """Total time of a few runs at 1 thread and at ``threads`` threads, interleaved; True if 1 is
    faster."""
    total = {1: 0.0, threads: 0.0}
    try:
        for round_ in range(_RUNS + 1):  # the first round warms both settings up
            for count in (1, threads):
                torch.set_num_threads(count)
                start = time.perf_counter()
                call()
                if round_:
                    total[count] += time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return total[1] < total[threads]


def single_thread_choices() -> dict[tuple[Hashable, int], bool]:
    """What was measured: (key, thread count) -> whether one thread runs it."""
    with _lock:
        return dict(_cache)


def clear() -> None:
    """Forget the measurements (tests; a process whose CPU share changed)."""
    with _lock:
        _cache.clear()
        _calls.clear()
