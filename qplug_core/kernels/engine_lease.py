"""Who may set torch's process-global quantized engine, and when.

Ops without packed weights (add, avg pooling, clamps on quantized tensors) and weight packing read
``torch.backends.quantized.engine`` when they run, so a thread running an fbgemm model and one
running a qnnpack model cannot both have their engine at once. A lease lets any number of threads
run under the same engine together (N threads serving one fbgemm model keep their parallelism); a
thread needing another engine waits until the holders leave, and threads arriving after it wait
behind it, so a steady stream of fbgemm calls cannot starve it. The last holder to leave puts
back the engine the first one found.

A thread holds at most one lease: a call needing another engine inside a call that holds one (a
qnnpack model run inside an fbgemm model's forward) gives the outer lease up while it waits and
takes it back afterwards, so two threads nesting that way cannot deadlock; the outer call's ops
run only once it is back.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["acquire", "release"]


class _Lease:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # taken directly where nothing waits: Condition's is Python code
        self.changed = threading.Condition(self.lock)
        self.engine: str | None = None  # the engine the holders run under
        self.holders = 0  # threads holding it, each once however deep its calls nest
        self.found = ""  # the global engine the first holder found
        self.waiting: list[list[str]] = []  # one ticket per waiting thread, in arrival order
        self.local = threading.local()  # .engines: this thread's nested leases, innermost last

    def admits(self, ticket: list[str]) -> bool:
        """A waiter may enter once the holders run its engine (or are gone) and every thread
        waiting ahead of it wants that engine too."""
        engine = ticket[0]
        if self.holders and self.engine != engine:
            return False
        return all(ahead[0] == engine for ahead in self.waiting[:self.waiting.index(ticket)])

    def take(self, engine: str) -> None:
        """Join the holders of ``engine`` (under ``lock``), waiting for holders of another."""
        try:
            if self.waiting or (self.holders and self.engine != engine):
                self.wait_for(engine)
            if not self.holders:
                found = torch.backends.quantized.engine
                if found != engine:
                    torch.backends.quantized.engine = engine  # raises for an engine torch lacks
                self.engine, self.found = engine, found
        except BaseException:  # interrupted, or no such engine: the threads waiting behind it go on
            self.changed.notify_all()
            raise
        self.holders += 1

    def wait_for(self, engine: str) -> None:
        ticket = [engine]
        self.waiting.append(ticket)
        try:
            while not self.admits(ticket):
                self.changed.wait()
        finally:
            self.waiting.remove(ticket)

    def give_back(self) -> None:
        """Leave the holders (under ``lock``); the last one restores the engine it was found with."""
        self.holders -= 1
        if not self.holders:
            if self.found != self.engine:
                torch.backends.quantized.engine = self.found
            self.engine = None
            if self.waiting:
                self.changed.notify_all()


_LEASE = _Lease()


def acquire(engine: str) -> None:
    """Run this thread under ``engine`` until the matching :func:`release`, sharing it with other
    threads that need the same engine; blocks while threads hold another."""
    held = _LEASE.local.__dict__.setdefault("engines", [])
    if not held or held[-1] != engine:
        with _LEASE.lock:
            if held:
                _LEASE.give_back()
            try:
                _LEASE.take(engine)
            except BaseException:
                if held:
                    _LEASE.take(held[-1])
                raise
    held.append(engine)


def release() -> None:
    """End this thread's innermost :func:`acquire` (taking back the lease of the call around it)."""
    held = _LEASE.local.engines
    engine = held.pop()
    if not held or held[-1] != engine:
        with _LEASE.lock:
            _LEASE.give_back()
            if held:
                _LEASE.take(held[-1])
