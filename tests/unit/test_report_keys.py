"""Report keys name what users can look up: ``model.get_submodule(key)`` for every module op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.norm = nn.GroupNorm(2, 8)  # float in the default mapping: listed in skipped

    def forward(self, x):
        return self.norm(torch.relu(self.bn(self.conv(x))) + x)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Sequential(Block(), Block()),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 4)).eval()


def test_every_module_key_is_a_qualified_module_name(plugin_autoload):
    model = _model()
    example = (torch.randn(1, 3, 8, 8),)
    qmodel = qp.quantize(model, example, [torch.randn(2, 3, 8, 8)], backend="fbgemm",
                         progress=False)
    report = qp.quantization_report(qmodel)
    assert {"0", "1.0.conv", "1.1.conv", "3"} <= set(report.quantized)
    assert report.kernels["1.0.conv"] == "quantized::conv2d" and report.kernels["3"]
    module_ops = {"Conv2d", "ConvReLU2d", "Linear", "GroupNorm", "Flatten"}
    for key in [*report.quantized, *report.kernels, *(s.node for s in report.skipped
                                                      if s.op in module_ops)]:
        if key in report.quantized and report.quantized[key] in ("add", "add_relu"):
            continue  # functional ops keep their node name
        model.get_submodule(key)  # raises AttributeError for a node name such as "1_0_conv"
    assert {"1.0.norm", "1.1.norm"} <= {s.node for s in report.skipped}


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_a_delegating_backend_names_anchors_as_the_report_does(plugin_autoload, backend, tmp_path):
    """``report.kernels`` and ``report.reference`` key the int8 regions as ``report.quantized``
    does (``1.0.conv``, not the node name ``1_0_conv``), and ``qp.load`` keeps what they say."""
    model = _model()
    qmodel = qp.quantize(model, (torch.randn(1, 3, 8, 8),), [torch.randn(2, 3, 8, 8)],
                         backend=backend, progress=False)
    report = qp.quantization_report(qmodel)
    assert report.partitions and set(report.kernels) | set(report.reference) == set(report.quantized)
    assert report.kernels["1.0.conv"] == f"delegate:{report.partitions[0]['name']}"
    qp.save(qmodel, tmp_path / "model.qplug")
    loaded = qp.quantization_report(qp.load(tmp_path / "model.qplug"))
    assert (loaded.kernels, loaded.reference) == (report.kernels, report.reference)
