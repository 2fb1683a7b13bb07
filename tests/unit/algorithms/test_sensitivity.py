"""qp.sensitivity from one calibration: the figures of two quantizations per layer, for the cost of one."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.flows import steps

pytestmark = pytest.mark.usefixtures("one_thread")

#: dB by which a layer's figures from one calibration may differ from its own quantizations' on
#: this model (measured: below 0.01 dB, fbgemm on AVX-512 VNNI; bench/bench_sensitivity.py has
#: the differences on other models, up to 10 dB where the grids change with the neighbours)
TOLERANCE_DB = 0.25


class _SmallCNN(nn.Module):
    """conv -> relu -> conv -> relu -> 1x1 conv -> linear; conv2's weights spread over channels as
    trained ones do, fc's input has a channel 30x the rest."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2, self.conv3 = nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 8, 1)
        self.fc = nn.Linear(8 * 8 * 8, 10)
        with torch.no_grad():
            self.conv2.weight.mul_(torch.logspace(-1, 1, 16).view(16, 1, 1, 1))
            self.conv3.weight[0] *= 30.0

    def forward(self, x):
        x = self.conv3(torch.relu(self.conv2(torch.relu(self.conv1(x)))))
        return self.fc(x.flatten(1))


def _images(n: int = 2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, 8, generator=g),) for _ in range(n)]


@pytest.mark.slow  # exact=True: nine quantizations, 3-10 s on a shared core
def test_one_calibration_gives_the_figures_of_a_quantization_per_layer(plugin_autoload):
    model, data = _SmallCNN().eval(), _images()
    fast = qp.sensitivity(model, data[0], data, backend="fbgemm")
    exact = qp.sensitivity(model, data[0], data, backend="fbgemm", exact=True)
    assert [s.name for s in fast.layers][:3] == [s.name for s in exact.layers][:3]
    assert fast.all_int8 == exact.all_int8  # both the backend's own converted model
    by_name = {s.name: s for s in exact.layers}
    for s in fast.layers:
        want = by_name[s.name]
        assert abs(s.alone_int8.sqnr_db - want.alone_int8.sqnr_db) < TOLERANCE_DB, s.name
        assert abs(s.alone_float.sqnr_db - want.alone_float.sqnr_db) < TOLERANCE_DB, s.name


def test_one_calibration_and_two_forward_passes_per_layer(monkeypatch, plugin_autoload):
    counts = {"calibrate": 0, "convert_fx": 0, "convert_to_reference_fx": 0, "score": 0}

    def counting(module, name):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)

    for name in ("calibrate", "convert_fx", "convert_to_reference_fx"):
        counting(steps, name)
    # the module (qplug_core.algorithms.sensitivity as an attribute is the function)
    counting(importlib.import_module("qplug_core.algorithms.sensitivity"), "score")
    model, data = _SmallCNN().eval(), _images()
    report = qp.sensitivity(model, data[0], data, backend="fbgemm")
    layers = len(report.layers)
    assert layers == 4
    # exact=True (as before): 1 + 2 x layers of each
    assert counts == {"calibrate": 1, "convert_fx": 1, "convert_to_reference_fx": 1, "score": 1 + 2 * layers}


class _Reused(nn.Module):
    """One linear called twice in forward: each call is a layer of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.mid(torch.relu(self.mid(torch.relu(self.inp(x)))))


def test_a_layer_called_twice_is_named_by_its_module_and_call_in_both_measurements(plugin_autoload):
    """exact=True raised NothingQuantizedError (a rule for the second call's copy was not read), and
    the report named that call ``mid_call1``, a name the model does not have."""
    model, data = _Reused().eval(), [(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)),)
                                     for i in range(2)]
    fast = qp.sensitivity(model, data[0], data, backend="fbgemm")
    exact = qp.sensitivity(model, data[0], data, backend="fbgemm", exact=True)
    names = {"inp", "mid (call 1)", "mid (call 2)"}
    assert {s.name for s in fast.layers} == {s.name for s in exact.layers} == names
    by_name = {s.name: s for s in exact.layers}
    for s in fast.layers:
        assert s.layers == (s.name,)
        assert abs(s.alone_int8.sqnr_db - by_name[s.name].alone_int8.sqnr_db) < TOLERANCE_DB, s.name
        assert abs(s.alone_float.sqnr_db - by_name[s.name].alone_float.sqnr_db) < TOLERANCE_DB, s.name
    assert "'name (call k)': the k-th call of a module forward calls more than once" in str(fast)
