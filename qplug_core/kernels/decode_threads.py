"""Whether a short call repeated at decode runs faster on the calling thread alone, measured on the calls themselves.

At decode (one token), each linear is one short kernel call (~50 us at 1024 x 1024 int8). With
more than one intra-op thread, every call is also a fork/join of the OpenMP team; when the other
threads are not running (a CPU shared with other work), each call waits for the scheduler to wake
them. Measured in a Llama decoder on a 2-core AMD EPYC Zen 4 at load ~7: oneDNN's one-token int8
linear took 6-20 ms per call at 2 threads against ~0.05 ms at 1, while fp32's matmuls lost only
2x (``bench/bench_llm.py``). Where the machine is quiet and the weights large, more threads win;
so the choice is measured per kind of call and thread count (:class:`ThreadChoice`): successive
calls alternate between the two settings, and the choice is measured again every
``remeasure_every`` calls, as the load of a shared machine changes. The calls measured are the
real ones, not repeats of one call: back to back, a repeat finds the other threads still
spinning, which the next real call, after the work between calls, does not. The settings are
compared by their total time, not their best run: at load ~7 the best of three 2-thread calls hit
a moment the worker was running and chose 2 threads, while the typical 2-thread call waited
milliseconds (a 4-layer W8A8 decode step 299 ms against 195 ms on one thread). Only the thread
count of the call changes (``torch.set_num_threads`` for its duration, restored after, also when
the call raises).

Two users: :func:`run_with_fastest_threads` (one kernel call, keyed by kernel and shape) and
:mod:`qplug_core.weight_only.decode_step` (a whole one-token decode step of a model).

The reverse also pays: a decode step measured faster on one thread still has the other cores,
and a kernel with a thread pool of its own that does not spin between calls (ONNX Runtime's
``MatMulNBits`` sessions) can use them without waking torch's OpenMP team for every small op.
Within :func:`thread_budget`, :func:`run_within_budget` runs each kernel call on the budget's
thread count where that measured faster than the caller's single thread (a 220 M Llama's int8
weight-only linears: 21.9 ms of kernels per token on one thread, 17.8 ms at two, Intel Xeon with
VNNI; ``bench/bench_llm.py``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

import torch

#: measured calls per setting (after one warm-up call of each)
RUNS = 3
#: kernel calls of one (key, thread count) between two measurements
REMEASURE_EVERY = 512
#: (key, thread count, the caller's thread count) -> its choice
_choices: dict[tuple[Hashable, int, int], ThreadChoice] = {}
_lock = threading.Lock()
_budget = threading.local()
T = TypeVar("T")


class ThreadChoice:
    """For one kind of call at one thread count ``threads``: whether it runs faster on 1 thread.

    Calls arrive on the ``caller``'s thread count (``threads`` unless given: a decode step's
    kernels arrive on 1 and may take ``threads``), which is restored after each. The first
    ``2 * (RUNS + 1)`` calls alternate between 1 and ``threads`` threads (the first of each warms
    it up) and their total times decide; so does every ``remeasure_every``-th call and the ones
    after it. ``clock`` is injectable so that tests can decide the timings. A choice ``single``
    made before (a file's record) skips the first measurement, not the later ones.
    """

    def __init__(self, threads: int, remeasure_every: int = REMEASURE_EVERY,
                 clock: Callable[[], float] = time.perf_counter, caller: int | None = None,
                 single: bool | None = None) -> None:
        self.threads, self.remeasure_every, self.clock = threads, remeasure_every, clock
        self.caller = threads if caller is None else caller
        #: the choice: ``True`` one thread, ``False`` ``threads``, ``None`` not measured yet
        self.single: bool | None = single
        #: the last measurement: thread count -> total seconds of its ``RUNS`` timed calls
        self.totals: dict[int, float] = {}
        self.calls = 0
        self.measurements = 0
        self._plan: list[int] = []
        self._timed = 0
        self._sums: dict[int, float] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy`` of a model holding one) gets a lock of its own."""
        return {k: v for k, v in vars(self).items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._lock = threading.Lock()

    def run(self, call: Callable[[], T]) -> T:
        """``call()`` on the thread count chosen (or the next one to measure)."""
        count, measuring = self._next()
        if count != self.caller:
            torch.set_num_threads(count)
        start = self.clock() if measuring else 0.0
        try:
            return call()
        finally:
            if measuring:
                elapsed = self.clock() - start
            if count != self.caller:
                torch.set_num_threads(self.caller)
            if measuring:
                self._record(count, elapsed)

    def _next(self) -> tuple[int, bool]:
        with self._lock:
            self.calls += 1
            if not self._plan and self._timed == 0 and (
                    self.single is None or self.calls % self.remeasure_every == 0):
                self._plan = [1, self.threads] * (RUNS + 1)
                self._sums = {1: 0.0, self.threads: 0.0}
            if self._plan:
                return self._plan.pop(0), True
            return (1 if self.single else self.threads), False

    def _record(self, count: int, elapsed: float) -> None:
        with self._lock:
            self._timed += 1
            if self._timed > 2:  # the first call of each setting warms it up
                self._sums[count] += elapsed
            if self._timed == 2 * (RUNS + 1):
                self.totals, self._timed = dict(self._sums), 0
                self.single = self._sums[1] < self._sums[self.threads]
                self.measurements += 1


def run_with_fastest_threads(key: Hashable, call: Callable[[], T]) -> T:
    """``call()``, on one thread when that measured faster than ``torch.get_num_threads()``
    threads for the calls of ``key`` (a :class:`ThreadChoice` per key and thread count)."""
    threads = torch.get_num_threads()
    if threads == 1:
        return call()
    return _choice(key, threads, threads).run(call)


@contextlib.contextmanager
def thread_budget(threads: int) -> Iterator[None]:
    """Within: :func:`run_within_budget` calls (on this Python thread) may take up to ``threads``
    threads while the rest runs on fewer."""
    before = getattr(_budget, "threads", 0)
    _budget.threads = threads
    try:
        yield
    finally:
        _budget.threads = before


def run_within_budget(key: Hashable, call: Callable[[], T]) -> T:
    """``call()``; inside a :func:`thread_budget` above ``torch.get_num_threads()``, on the
    budget's thread count where that measured faster for the calls of ``key``."""
    budget = getattr(_budget, "threads", 0)
    if budget <= 1:
        return call()
    caller = torch.get_num_threads()
    if budget <= caller:
        return call()
    choice = _choices.get((key, budget, caller))  # no lock: a dict lookup is atomic
    return (choice or _choice(key, budget, caller)).run(call)


def _choice(key: Hashable, threads: int, caller: int) -> ThreadChoice:
    with _lock:
        choice = _choices.get((key, threads, caller))
        if choice is None:
            choice = _choices[key, threads, caller] = ThreadChoice(threads, caller=caller)
        return choice


def single_thread_choices() -> dict[tuple[Hashable, int], bool]:
    """What was measured: (key, thread count) -> whether one thread runs it (for tests and bench/)."""
    with _lock:
        return {(key, threads): choice.single for (key, threads, _), choice in _choices.items()
                if choice.single is not None}


def clear() -> None:
    """Forget the measurements (tests; a process whose CPU share changed)."""
    with _lock:
        _choices.clear()
