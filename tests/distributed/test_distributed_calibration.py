"""Calibration on 2 gloo ranks gives the int8 model one process gets on the global batches.

``calibration_worker.py`` runs as 2 ranks plus a single-process reference, all at once, over every
case (one process group for all of them); here the files they wrote are compared byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import launch
import pytest
import torch
from calibration_worker import MODEL_CASES, observer_zoo
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
CASES = [*MODEL_CASES, "dynamic", "sampler"]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    out = tmp_path_factory.mktemp("calibration")
    results = launch.run_script(HERE / "calibration_worker.py", str(out), world=2,
                                with_single=True, timeout=240,
                                extra_env={"TTY_INTERACTIVE": "1", "TTY_COMPATIBLE": "1"})
    return out, results


def read(out: Path, case: str, who: str) -> tuple[bytes, dict, dict]:
    return launch.saved_model(out / f"{case}.{who}.safetensors")


@pytest.mark.parametrize("case", CASES)
def test_rank0_saves_the_single_process_model_byte_for_byte(written, case):
    out, _ = written
    assert read(out, case, "0") == read(out, case, "single")


@pytest.mark.parametrize("case", CASES)
def test_every_rank_converts_to_the_same_model(written, case):
    out, _ = written
    assert read(out, case, "1") == read(out, case, "0")


def test_every_shipped_observer_class_agrees_with_one_process(written):
    out, _ = written
    ranks = [load_file(str(out / f"zoo.{who}.safetensors")) for who in ("0", "1")]
    single = load_file(str(out / "zoo.single.safetensors"))
    names = {str(i): type(m).__name__ for i, m in enumerate(observer_zoo())}
    assert set(single) == set(ranks[0]) == set(ranks[1])
    for key, expected in single.items():
        for rank, state in enumerate(ranks):
            assert torch.equal(state[key], expected), (
                f"{names[key.split('.')[0]]} ({key}) on rank {rank}: {state[key]} != {expected}")
    # every class with statistics saw data: the comparison above is not between empty states
    assert {names[k.split(".")[0]] for k in single if "qparams" in k} >= {
        "MinMaxObserver", "MovingAverageMinMaxObserver", "PerChannelMinMaxObserver",
        "MovingAveragePerChannelMinMaxObserver", "HistogramObserver", "PercentileObserver",
        "MSEObserver", "FixedQParamsObserver", "FakeQuantize", "FixedQParamsFakeQuantize",
        "LearnableFakeQuantize"}


def test_observers_called_twice_per_forward_agree_with_one_process(written):
    out, _ = written
    assert ((out / "twice.0.safetensors").read_bytes() == (out / "twice.1.safetensors").read_bytes()
            == (out / "twice.single.safetensors").read_bytes())


def test_final_reduction_alone_is_exact_for_min_max_observers(written):
    out, _ = written
    ranks = [load_file(str(out / f"custom_loop.{who}.safetensors")) for who in ("0", "1")]
    single = load_file(str(out / "zoo.single.safetensors"))
    # custom_loop's observers 0 and 1 are the zoo's 0 (MinMax) and 2 (PerChannelMinMax)
    for key in ("min_val", "max_val"):
        for state in ranks:
            assert torch.equal(state[f"0.{key}"], single[f"0.{key}"])
            assert torch.equal(state[f"1.{key}"], single[f"2.{key}"])


def test_undeclared_observer_and_uneven_shards_raise_on_every_rank(written):
    out, _ = written
    for who in ("0", "1"):
        undeclared, uneven = (out / f"errors.{who}.txt").read_text().splitlines()
        assert undeclared.startswith("DistributedCalibrationError: ")
        assert "__main__.UndeclaredObserver does not declare how its statistics reduce" in undeclared
        assert "ran out of calibration batches at different steps (step 2" in uneven


def test_progress_bar_only_on_rank_zero(written):
    _, results = written  # the sampler case asks both ranks for a progress bar
    assert "calibrating" in results[0].stdout
    assert "calibrating" not in results[1].stdout + results[1].stderr
