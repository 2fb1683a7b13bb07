"""``qp.compare`` rows for layers made from functional calls: ``F.conv2d(x, self.w)`` becomes the int8
module ``conv2d_module``, which the float model does not have; compare printed no row for it and said
nothing (only the output SQNR covered it)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp


class FunctionalNet(nn.Module):
    """A functional conv + F.relu6 (absorbed into the conv's int8 range), a functional linear, an nn.Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.3)
        self.b1 = nn.Parameter(torch.randn(8) * 0.1)
        self.w2 = nn.Parameter(torch.randn(16, 8) * 0.3)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu6(F.conv2d(x, self.w1, self.b1, padding=1))
        return self.fc(F.linear(y.mean((2, 3)), self.w2))


def _by_hand(model: FunctionalNet, qmodel: nn.Module, data: list) -> dict[str, float]:
    """Each layer's SQNR over ``data``: the float values computed here, the int8 ones from hooks."""
    float_values: dict[str, list[torch.Tensor]] = {"conv2d_module": [], "linear_module": [], "fc": []}
    int8_values: dict[str, list[torch.Tensor]] = {name: [] for name in float_values}
    modules = dict(qmodel.named_modules())
    handles = [modules[name].register_forward_hook(
        lambda m, a, out, name=name: int8_values[name].append(out.dequantize() if out.is_quantized else out))
        for name in int8_values]
    with torch.no_grad():
        for (x,) in data:
            conv = F.relu6(F.conv2d(x, model.w1, model.b1, padding=1))
            linear = F.linear(conv.mean((2, 3)), model.w2)
            for name, value in zip(float_values, (conv, linear, model.fc(linear))):
                float_values[name].append(value)
            qmodel(x)
    for handle in handles:
        handle.remove()
    db = {}
    for name in float_values:
        ref = torch.cat([t.double().flatten() for t in float_values[name]])
        test = torch.cat([t.double().flatten() for t in int8_values[name]])
        db[name] = 10 * math.log10(float(ref.square().sum() / (ref - test).square().sum()))
    return db


@pytest.mark.parametrize("capture", ["symbolic", "export"])
def test_functional_layers_have_rows_with_the_figures_measured_by_hand(plugin_autoload, capture, tmp_path):
    torch.manual_seed(0)
    model = FunctionalNet().eval()
    data = [(torch.randn(2, 3, 8, 8),) for _ in range(3)]
    qmodel = qp.quantize(model, data[0], data, backend="fbgemm", capture=capture, progress=False)
    loaded = qp.load(qp.save(qmodel, tmp_path / "model.safetensors"))
    for quantized in (qmodel, loaded):
        report = qp.compare(model, quantized, data)
        rows = {layer.name: (layer.float_type, layer.sqnr_db) for layer in report.layers}
        assert list(rows) == ["conv2d_module", "linear_module", "fc"] and not report.skipped
        assert [kind for kind, _ in rows.values()] == ["F.conv2d+relu6", "F.linear", "Linear"]
        for name, db in _by_hand(model, quantized, data).items():
            assert rows[name][1] == pytest.approx(db, abs=1e-6) and db > 25


class SharedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x, self.w)), self.w)


def test_functional_layers_compare_cannot_pair_are_listed_in_skipped_with_the_reason(plugin_autoload):
    """Two calls on one weight become two int8 layers: which float call is whose is not known."""
    torch.manual_seed(0)
    model = SharedWeight().eval()
    data = [(torch.randn(4, 8),)]
    report = qp.compare(model, qp.quantize(model, data[0], data, backend="fbgemm", progress=False), data)
    assert not report.layers and len(report.skipped) == 2
    assert all("one of 2 functional calls on weight 'w'" in reason for reason in report.skipped.values())
