"""Eager mode on fbgemm with a depthwise conv: eager prepare has no graph for fbgemm's 7-bit
depthwise pass, so the conv's inputs keep 8 bits and fbgemm's kernel refuses them (its int16 pair
sums would saturate); the conv runs in reference form instead, with a warning."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.analysis import sqnr
from qplug_core.eager import DeQuantStub, QuantStub

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class DepthwiseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.relu = nn.ReLU()
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.fc = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.depthwise(self.relu(self.conv(self.quant(x))))
        return self.dequant(self.fc(torch.flatten(x, 1)))


def _converted(backend: str) -> nn.Module:
    torch.manual_seed(0)
    model = DepthwiseNet().eval()
    with torch.no_grad():
        model.depthwise.weight.abs_()  # positive weights on non-negative inputs: pairs add up
    observed = qp.eager.prepare(qp.eager.fuse_modules(model, [["conv", "relu"]]), backend=backend)
    with torch.no_grad():
        for seed in range(4):
            observed(torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(seed)))
    return qp.eager.convert(observed, backend=backend)


def test_a_depthwise_conv_fbgemm_refuses_runs_in_reference_form_with_a_warning():
    with pytest.warns(UserWarning, match=r"backend 'fbgemm': kernel quantized::conv2d refused a Conv2d: .*"
                                         r"it runs in reference form between a dequantize and a quantize"):
        on_fbgemm = _converted("fbgemm")
    reference = _converted("reference")
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert float(sqnr(reference(x), on_fbgemm(x))) > 35  # was ~20 dB when the kernel ran saturated
