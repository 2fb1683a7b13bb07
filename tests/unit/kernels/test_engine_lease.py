"""The engine lease: who runs under torch's global quantized engine, in which order (the models
built on it: tests/reliability/test_threads.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from qplug_core.kernels import engine_lease


def waiting_threads(count: int) -> None:
    """Return once ``count`` threads wait for the lease (they block inside ``acquire``)."""
    deadline = time.monotonic() + 10
    while len(engine_lease._LEASE.waiting) < count:
        assert time.monotonic() < deadline, "the threads never queued"
        time.sleep(0.001)


def test_a_thread_waiting_for_another_engine_goes_before_later_threads_of_the_held_one():
    """A steady stream of fbgemm calls must not starve a qnnpack one: fbgemm threads arriving
    after it wait behind it, then run together again, and the user's engine is back at the end."""
    user = torch.backends.quantized.engine
    order, lock, entered, leave = [], threading.Lock(), threading.Event(), threading.Event()

    def hold(engine: str, name: str, until: threading.Event | None = None) -> None:
        engine_lease.acquire(engine)
        with lock:
            order.append((name, torch.backends.quantized.engine))
        if until is not None:
            entered.set()
            until.wait(10)
        engine_lease.release()

    first = threading.Thread(target=hold, args=("fbgemm", "first", leave))
    first.start()
    assert entered.wait(10)
    queued = [threading.Thread(target=hold, args=("qnnpack", "qnnpack"))]
    queued[0].start()
    waiting_threads(1)
    queued += [threading.Thread(target=hold, args=("fbgemm", f"later {i}")) for i in range(2)]
    for thread in queued[1:]:
        thread.start()
    waiting_threads(3)
    assert order == [("first", "fbgemm")]  # the later fbgemm threads did not join the holder
    leave.set()
    for thread in [first, *queued]:
        thread.join(10)
    assert order[:2] == [("first", "fbgemm"), ("qnnpack", "qnnpack")]
    assert sorted(order[2:]) == [("later 0", "fbgemm"), ("later 1", "fbgemm")]
    assert torch.backends.quantized.engine == user


def test_an_engine_torch_lacks_raises_and_leaves_the_lease_usable():
    user = torch.backends.quantized.engine
    engine_lease.acquire("fbgemm")
    with pytest.raises(RuntimeError, match="not a valid value for quantized engine"):
        engine_lease.acquire("no-such-engine")
    assert torch.backends.quantized.engine == "fbgemm"  # the outer lease is held again
    engine_lease.release()
    assert torch.backends.quantized.engine == user
    done = threading.Thread(target=lambda: (engine_lease.acquire("qnnpack"), engine_lease.release()))
    done.start()
    done.join(10)
    assert not done.is_alive()  # nothing was left holding fbgemm
