"""Denormal floats in ORT sessions (``SessionSettings.flush_denormals``).

A float32 below 1.2e-38 is zero on every int8 grid but many times slower to compute with than a
normal float (Softmax over attention scores makes millions). By default qplug's sessions compute
such values as zero, on ORT's threads and on the calling thread, and leave the caller's own
floating-point mode as it was; ``configure(flush_denormals=False)`` keeps IEEE denormals.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import ConfigValidationError, denormals_flushed

from qplug_onnxruntime import SessionSettings
from qplug_onnxruntime.session import OrtPartition

NORMAL_MIN = torch.finfo(torch.float32).tiny  # 1.1755e-38


class TinyOutputs(nn.Module):
    """A linear, softmax, then a float scale that puts every output below float32's normal range."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.linear(x), -1) * 1e-38


def _denormals(t: torch.Tensor) -> int:
    return int(((t != 0) & (t.abs() < NORMAL_MIN)).sum())


@pytest.fixture(scope="module")
def qmodel():
    torch.manual_seed(0)
    model = TinyOutputs().eval()
    g = torch.Generator().manual_seed(0)
    calibration = [(torch.randn(4, 16, generator=g),) for _ in range(4)]
    qmodel = qp.quantize(model, calibration[0], calibration, backend="onnxruntime", recipe="none")
    assert [type(m) for m in qmodel.modules() if isinstance(m, OrtPartition)] == [OrtPartition]
    return model, qmodel, calibration[0]


@pytest.mark.parametrize("threads", [1, 2])
def test_values_below_the_normal_range_come_out_as_zero_and_ieee_denormals_on_request(qmodel, threads):
    model, qmodel, x = qmodel
    (partition,) = [m for m in qmodel.modules() if isinstance(m, OrtPartition)]
    assert _denormals(model(*x)) == x[0].numel()  # float computes them all as denormals
    flushing, keeping = copy.deepcopy(qmodel), copy.deepcopy(qmodel)
    (p,) = [m for m in flushing.modules() if isinstance(m, OrtPartition)]
    p.rebuild(SessionSettings(num_threads=threads))
    (p,) = [m for m in keeping.modules() if isinstance(m, OrtPartition)]
    p.rebuild(SessionSettings(num_threads=threads, flush_denormals=False))
    with torch.no_grad():
        flushed, kept = flushing(*x), keeping(*x)
    assert partition.flush_denormals and _denormals(flushed) == 0 and int((flushed != 0).sum()) == 0
    assert _denormals(kept) == x[0].numel()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_callers_floating_point_mode_is_left_as_it_was(qmodel, threads, tmp_path):
    _, qmodel, x = qmodel
    assert not denormals_flushed()
    clone = copy.deepcopy(qmodel)
    (p,) = [m for m in clone.modules() if isinstance(m, OrtPartition)]
    p.rebuild(SessionSettings(num_threads=threads))  # a one-thread ORT session sets the builder's mode
    assert not denormals_flushed()
    with torch.no_grad():
        clone(*x)
    assert not denormals_flushed()
    qp.save(clone, tmp_path / "m.qplug")
    loaded = qp.load(tmp_path / "m.qplug")
    assert not denormals_flushed()
    torch.set_flush_denormal(True)  # a caller that flushes keeps flushing
    try:
        with torch.no_grad():
            torch.testing.assert_close(loaded(*x), clone(*x), rtol=0, atol=0)
        assert denormals_flushed()
    finally:
        torch.set_flush_denormal(False)


def test_flush_denormals_must_be_a_bool():
    with pytest.raises(ConfigValidationError, match="flush_denormals must be True or False"):
        SessionSettings(flush_denormals=1)  # type: ignore[arg-type]
