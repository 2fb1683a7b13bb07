"""The engine lease: who runs under torch's global quantized engine, in which order (the models
built on it: tests/reliability/test_threads.py)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from qplug_core.kernels import engine_lease


def waiting_threads(count: int) -> None:
    """Return once ``count`` threads wait for the lease (they block inside ``acquire``)."""
    deadline = time.monotonic() + 10
    while len(engine_lease._LEASE.waiting) < count:
        assert time.monotonic() < deadline, "the threads never queued"
        time.sleep(0.001)


def test_a_thread_for_another_engine_waits_only_while_the_holders_overlap():
    """Threads of the held engine join past a waiter for another engine (queueing them could
    deadlock); the waiter enters once the holders leave, and the user's engine is back at the end."""
    user = torch.backends.quantized.engine
    order, lock, entered, leave = [], threading.Lock(), threading.Event(), threading.Event()

    def hold(engine: str, name: str, until: threading.Event | None = None) -> None:
        token = engine_lease.acquire(engine)
        with lock:
            order.append((name, torch.backends.quantized.engine))
        if until is not None:
            entered.set()
            until.wait(10)
        engine_lease.release(token)

    first = threading.Thread(target=hold, args=("qnnpack", "first", leave))
    first.start()
    assert entered.wait(10)
    waiter = threading.Thread(target=hold, args=("fbgemm", "waiter"))
    waiter.start()
    waiting_threads(1)
    later = threading.Thread(target=hold, args=("qnnpack", "later"))
    later.start()
    later.join(10)
    assert not later.is_alive()  # it joined the holder, though the fbgemm thread came first
    leave.set()
    for thread in (first, waiter):
        thread.join(10)
        assert not thread.is_alive()
    assert order == [("first", "qnnpack"), ("later", "qnnpack"), ("waiter", "fbgemm")]
    assert torch.backends.quantized.engine == user


def test_a_forward_waiting_on_a_worker_of_its_engine_does_not_deadlock_behind_another_engine():
    """A pinned fbgemm model whose forward waits on a worker thread running another fbgemm model,
    while a qnnpack call queues in between (tests/reliability/test_threads.py has the models)."""
    outer = engine_lease.acquire("fbgemm")
    queued = threading.Thread(target=lambda: engine_lease.release(engine_lease.acquire("qnnpack")))
    queued.start()
    waiting_threads(1)
    ran = []

    def work() -> None:
        token = engine_lease.acquire("fbgemm")
        ran.append(torch.backends.quantized.engine)
        engine_lease.release(token)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and ran == ["fbgemm"]
    engine_lease.release(outer)
    queued.join(10)
    assert not queued.is_alive()


def test_an_engine_torch_lacks_raises_and_leaves_the_lease_usable():
    user = torch.backends.quantized.engine
    outer = engine_lease.acquire("fbgemm")
    with pytest.raises(RuntimeError, match="not a valid value for quantized engine"):
        engine_lease.acquire("no-such-engine")
    assert torch.backends.quantized.engine == "fbgemm"  # the outer lease is held again
    engine_lease.release(outer)
    assert torch.backends.quantized.engine == user
    done = threading.Thread(target=lambda: engine_lease.release(engine_lease.acquire("qnnpack")))
    done.start()
    done.join(10)
    assert not done.is_alive()  # nothing was left holding fbgemm


@contextlib.contextmanager
def interrupted_once_waiting() -> Iterator[None]:
    """Ctrl-C for this (the main) thread as soon as it waits for the lease: SIGUSR1 raises the
    KeyboardInterrupt, so pytest's own SIGINT handling stays out of it."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    sender = threading.Thread(target=lambda: (waiting_threads(1), signal.pthread_kill(main, signal.SIGUSR1)))
    main = threading.main_thread().ident
    sender.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        sender.join(10)
        signal.signal(signal.SIGUSR1, previous)


def holding_qnnpack(go: threading.Event, seen: list[str]) -> threading.Thread:
    """Another thread serving a qnnpack model until ``go``; it records the engine it runs under."""
    inside = threading.Event()

    def serve() -> None:
        token = engine_lease.acquire("qnnpack")
        inside.set()
        go.wait(10)
        seen.append(torch.backends.quantized.engine)
        engine_lease.release(token)

    thread = threading.Thread(target=serve)
    thread.start()
    assert inside.wait(10)
    return thread


def interrupted_taking_fbgemm_back(go: threading.Event, seen: list[str]) -> tuple[list[str], threading.Thread]:
    """An fbgemm call runs a qnnpack one inside while another thread serves qnnpack; Ctrl-C comes
    as the inner call waits to take fbgemm back. Returns the outer call's token and that thread."""
    outer = engine_lease.acquire("fbgemm")
    inner = engine_lease.acquire("qnnpack")
    other = holding_qnnpack(go, seen)
    with interrupted_once_waiting():
        engine_lease.release(inner)
    return outer, other


def test_ctrl_c_while_a_nested_call_takes_the_outer_lease_back_leaves_other_threads_theirs():
    """An fbgemm model's forward runs a qnnpack model, another thread serves a qnnpack model, and
    Ctrl-C comes while the inner call waits to take fbgemm back: the outer call's release must not
    give back a lease it no longer holds (the other thread's engine was switched under it, then
    the count went to -1 and every later call blocked)."""
    user = torch.backends.quantized.engine
    go, seen = threading.Event(), []
    outer, other = interrupted_taking_fbgemm_back(go, seen)
    engine_lease.release(outer)  # the outer forward's finally
    go.set()
    other.join(10)
    assert seen == ["qnnpack"]
    assert not engine_lease._LEASE.holding and torch.backends.quantized.engine == user
    later = threading.Thread(target=lambda: engine_lease.release(engine_lease.acquire("fbgemm")))
    later.start()
    later.join(10)
    assert not later.is_alive()


def test_after_ctrl_c_with_no_outer_release_the_next_call_holds_its_engine():
    """A graph-mode outer model gets no forward hook on KeyboardInterrupt, so its release never
    comes: the thread's next fbgemm call must still wait for the qnnpack holder and run under
    fbgemm (it ran with no lease, under qnnpack)."""
    go, seen = threading.Event(), []
    outer, other = interrupted_taking_fbgemm_back(go, seen)
    threading.Thread(target=lambda: (waiting_threads(1), go.set())).start()
    token = engine_lease.acquire("fbgemm")
    assert torch.backends.quantized.engine == "fbgemm" and seen == ["qnnpack"]
    engine_lease.release(token)
    engine_lease.release(outer)  # what stays held until then: docs/reliability.md H2
    other.join(10)
    assert not engine_lease._LEASE.holding
