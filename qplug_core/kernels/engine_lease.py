"""Who may set torch's process-global quantized engine, and when.

Ops without packed weights (add, avg pooling, clamps on quantized tensors) and weight packing read
``torch.backends.quantized.engine`` when they run, so a thread running an fbgemm model and one
running a qnnpack model cannot both have their engine at once. A lease lets any number of threads
run under the same engine together (N threads serving one fbgemm model keep their parallelism); a
thread needing another engine waits until the holders leave. A thread arriving for the engine held
joins at once, even past such a waiter: it may be a worker a holder's forward waits on, and queueing
it would deadlock (so under calls that overlap without pause, a waiter for another engine waits
until they pause). Once the lease is free, waiters enter in arrival order. The last holder to leave
puts back the engine the first one found.

A thread holds at most one lease: a call needing another engine inside a call that holds one (a
qnnpack model run inside an fbgemm model's forward) gives the outer lease up while it waits and
takes it back afterwards, so two threads nesting that way cannot deadlock; the outer call's ops
run only once it is back.

The holders are a set of thread ids, and a thread's calls a stack of tokens; every change of either
is one step, and what a thread holds is set from its stack (``_Lease.settle``), so an exception
(a ``KeyboardInterrupt`` while waiting) leaves at worst a thread holding less than its stack says,
which its next ``acquire``/``release`` mends, never a count off for other threads.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["acquire", "release"]

_ident = threading.get_ident


class _Lease:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # taken directly where nothing waits: Condition's is Python code
        self.changed = threading.Condition(self.lock)
        self.engine: str | None = None  # the engine the holders run under (None once it is put back)
        self.holding: set[int] = set()  # the threads holding it, each once however deep its calls nest
        self.found = ""  # the global engine the first holder found
        self.waiting: list[list[str]] = []  # one ticket per waiting thread, in arrival order
        self.local = threading.local()  # .calls: this thread's tokens ([engine]), innermost last

    def settle(self, me: int, engine: str | None) -> None:
        """Make thread ``me`` hold the lease on ``engine`` (None: no lease), under ``lock``."""
        if me in self.holding:
            if self.engine == engine:
                return
            self.leave(me)
        if engine is not None:
            self.enter(me, engine)

    def leave(self, me: int) -> None:
        self.holding.discard(me)
        if not self.holding:
            self.put_back()

    def enter(self, me: int, engine: str) -> None:
        """Join the holders of ``engine``, waiting while others hold another one."""
        try:
            if not self.holding or self.engine != engine:
                if self.holding or self.waiting:
                    self.wait_for(engine)
                if not self.holding:
                    if self.engine is not None:
                        self.put_back()  # a holder interrupted while leaving did not
                    self.found = torch.backends.quantized.engine
                    self.engine = engine
                    if self.found != engine:
                        torch.backends.quantized.engine = engine  # raises for an engine torch lacks
        except BaseException:  # interrupted, or no such engine: the threads waiting behind it go on
            self.changed.notify_all()
            raise
        self.holding.add(me)
        if self.waiting:
            self.changed.notify_all()  # waiters for this engine behind another one's may join now

    def admits(self, ticket: list[str]) -> bool:
        """A waiter joins holders of its engine; with none, it enters once no one ahead of it wants
        another engine."""
        if self.holding:
            return self.engine == ticket[0]
        return all(ahead[0] == ticket[0] for ahead in self.waiting[:self.waiting.index(ticket)])

    def wait_for(self, engine: str) -> None:
        ticket = [engine]
        self.waiting.append(ticket)
        try:
            while not self.admits(ticket):
                self.changed.wait()
        finally:
            self.waiting.remove(ticket)

    def put_back(self) -> None:
        """With no holders left, restore the engine the first one found (once)."""
        if self.engine is not None:
            if self.engine != self.found:
                torch.backends.quantized.engine = self.found
            self.engine = None
            if self.waiting:
                self.changed.notify_all()


_LEASE = _Lease()


def acquire(engine: str) -> list[str]:
    """Run this thread under ``engine`` until :func:`release` of the token returned, sharing it
    with other threads that need the same engine; blocks while threads hold another."""
    calls = _LEASE.local.__dict__.setdefault("calls", [])
    token = [engine]
    calls.append(token)
    me = _ident()
    if _LEASE.engine != engine or me not in _LEASE.holding:
        try:
            with _LEASE.lock:
                if me in _LEASE.holding:  # of another engine (an outer call's)
                    _LEASE.leave(me)
                _LEASE.enter(me, engine)
        except BaseException:
            release(token)  # back to the lease of the call around it
            raise
    return token


def release(token: list[str]) -> None:
    """End the call ``token`` came from (and calls inside it that never ended), taking back the
    lease of the call around it."""
    calls = _LEASE.local.calls
    if calls and calls[-1] is token:
        calls.pop()
    else:
        del calls[next((i for i, call in enumerate(calls) if call is token), len(calls)):]
    wanted = calls[-1][0] if calls else None
    me = _ident()
    if wanted is None:
        if me in _LEASE.holding:
            with _LEASE.lock:
                _LEASE.leave(me)
    elif _LEASE.engine != wanted or me not in _LEASE.holding:
        with _LEASE.lock:
            _LEASE.settle(me, wanted)
