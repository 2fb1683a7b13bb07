"""Run-wide test setup for every test path (tests/ and each plugin's tests/)."""

from __future__ import annotations

import os

import pytest
import torch

from qplug_core.registry import cpu_diagnostics


def _share_the_cores_between_xdist_workers() -> None:
    """Under ``pytest -n N`` each worker gets its share of the cores, so N workers do not run N x
    cores threads (OpenMP spin-waits make oversubscription several times slower); a thread count the
    user set in OMP_NUM_THREADS is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the subprocesses tests start
        torch.set_num_threads(threads)


_share_the_cores_between_xdist_workers()


def pytest_collection_modifyitems(items: list) -> None:
    """Modules holding a ``slow`` test run first (each module kept whole, in its own order): under
    ``pytest -n 2`` a minutes-long test picked up near the end kept one worker busy after the
    other had finished everything else."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow_modules)


@pytest.fixture(autouse=True)
def _slow_here_warning_given(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests run qnnpack on x86 hosts for its numbers, not its speed: the once-per-process warning
    that it is slower than float there counts as given, except in tests marked ``slow_here_warning``,
    which test it."""
    tested = request.node.get_closest_marker("slow_here_warning") is not None
    monkeypatch.setattr(cpu_diagnostics, "_warned", set() if tested else {"qnnpack"})
