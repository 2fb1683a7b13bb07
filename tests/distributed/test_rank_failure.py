"""A failure on one rank reaches every rank, in bounded time, with the original error (issue 27).

Two real gloo processes calibrate together and rank 1 fails in batch 1. Before, rank 0 waited
in its next collective as long as rank 1's process lived (36-94 s), then raised
``InputMismatchError: ... batch 1 does not fit the model``: the wrong diagnosis. Now rank 0 stops
at its next collective with :class:`RankFailedError` naming rank 1 and rank 1's own error, and rank
1 raises its error as before.
"""

from __future__ import annotations

from pathlib import Path

import launch
import pytest

WORKER = Path(__file__).with_name("failure_worker.py")


def _results(tmp_path: Path, case: str, timeout: float = 60, **env: str) -> dict[str, list[str]]:
    launch.run_script(WORKER, str(tmp_path), case, timeout=timeout, extra_env=env)
    return {path.stem: path.read_text().split("\n", 1) for path in tmp_path.glob("*.txt")}


@pytest.mark.parametrize("case, original", [
    ("nan", "NonFiniteCalibrationError"),
    ("shape", "InputMismatchError"),
])
def test_every_rank_stops_with_the_failed_ranks_error(tmp_path, case, original):
    results = _results(tmp_path, case)
    seconds0, error0 = results["0"]
    _, error1 = results["1"]
    assert error1.startswith(f"{original}: ")
    assert error0.startswith("RankFailedError: rank 1 failed, so this rank stopped too: "
                             f"{original}: ")
    assert error1 in error0  # the original message, whole
    assert float(seconds0) < 30  # bounded: the next collective, not the life of rank 1's process


def test_a_rank_that_dies_is_reported_as_gone_not_as_a_bad_batch(tmp_path):
    results = launch.run([launch.sys.executable, str(WORKER), str(tmp_path), "exit"], world=2,
                         timeout=60, extra_env={"QPLUG_DISTRIBUTED_TIMEOUT": "5"})
    assert results[1].returncode == 17
    assert results[0].returncode == 0, results[0].stderr[-3000:]
    seconds, error = (tmp_path / "0.txt").read_text().split("\n", 1)
    assert error.startswith("RanksLostError: rank 0: a collective failed or did not complete")
    assert "another rank has stopped" in error
    assert float(seconds) < 30
