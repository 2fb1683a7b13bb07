"""The clamps convert absorbed into a layer's int8 range survive save -> load: ``qp.compare`` of a
loaded model paired a conv whose ReLU6 convert dropped with the unclamped float conv (2.9 dB, not 40.9)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp
from qplug_core.flows.clamps import AbsorbedClamp, absorbed_clamps


class ClampedConvs(nn.Module):
    """conv+ReLU6, conv+clamp(0, 4), conv+clamp(min=0), and a functional conv+relu6."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU6()
        self.conv2, self.conv3 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.weight = nn.Parameter(torch.randn(8, 8, 1, 1) * 0.3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.clamp(self.conv2(self.act(self.conv1(x))), 0, 4)
        x = F.relu6(F.conv2d(torch.clamp(self.conv3(x), min=0), self.weight))
        return self.fc(x.mean((2, 3)))


def _rows(report: qp.ComparisonReport) -> list[tuple[str, str, float]]:
    return [(layer.name, layer.float_type, layer.sqnr_db) for layer in report.layers]


def test_a_loaded_model_pairs_its_layers_with_the_float_value_after_the_absorbed_clamp(plugin_autoload, tmp_path):
    torch.manual_seed(0)
    model = ClampedConvs().eval()
    data = [(torch.randn(2, 3, 8, 8) * 2,) for _ in range(2)]
    quantized = qp.quantize(model, data[0], data, backend="fbgemm", progress=False)
    path = qp.save(quantized, tmp_path / "model.safetensors")
    loaded = qp.load(path)
    assert absorbed_clamps(loaded) == absorbed_clamps(quantized) == {
        "conv1": AbsorbedClamp(0.0, 6.0, "ReLU6", "act"), "conv2": AbsorbedClamp(0.0, 4.0, "clamp", None),
        "conv3": AbsorbedClamp(0.0, float("inf"), "clamp", None),
        "conv2d_module": AbsorbedClamp(0.0, 6.0, "relu6", None)}  # the functional conv, as int8 runs it
    before, after = qp.compare(model, quantized, data), qp.compare(model, loaded, data)
    assert _rows(after) == _rows(before) and after.float_only == before.float_only == []
    assert [kind for _, kind, _ in _rows(after)] == ["Conv2d+ReLU6", "Conv2d+clamp", "Conv2d+clamp",
                                                     "F.conv2d+relu6", "Linear"]
    assert all(db > 30 for _, _, db in _rows(after))
    assert qp.save(loaded, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()
