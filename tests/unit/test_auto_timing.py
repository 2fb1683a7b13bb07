"""``backend="auto"``'s measurement: candidates that all run on the calling thread are timed in its
CPU seconds (a loaded machine's other processes do not count); one that waits (a runtime's own
threads, a device, a sleep) puts every candidate on wall time; one dropped early reads as a bound,
not as a ratio of two samples (time-series report, F7: "17.55x" for a ~2x gap)."""

from __future__ import annotations

import time

from qplug_core.flows.auto import DROP_RATIO, measure


def _busy(seconds: float):
    def call() -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
    return call


def test_candidates_computing_on_the_calling_thread_are_timed_in_its_cpu_time():
    medians, dropped, on_thread = measure({"a": _busy(2e-4), "b": _busy(4e-4)}, ())
    assert on_thread and not dropped
    assert medians["a"] < medians["b"]


def test_a_candidate_that_waits_puts_the_measurement_on_wall_time_and_is_dropped():
    medians, dropped, on_thread = measure({"busy": _busy(2e-4), "sleepy": lambda: time.sleep(0.02)}, ())
    assert not on_thread  # its sleep costs no CPU: in CPU time it would have looked fastest
    assert dropped == {"sleepy"} and medians["sleepy"] >= 0.02 > DROP_RATIO * medians["busy"]


def test_the_float_baseline_is_timed_every_round_and_drops_no_candidate():
    """A yardstick far faster than the candidates: they are compared with each other, not with it."""
    medians, dropped, _ = measure({"float": _busy(1e-5), "a": _busy(1e-4), "b": _busy(1.2e-4)}, (),
                                  baseline="float")
    assert not dropped and set(medians) == {"float", "a", "b"}
