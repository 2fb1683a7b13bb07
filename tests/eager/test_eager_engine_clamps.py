"""Eager mode on qnnpack: an ``nn.ReLU6`` after a conv runs on the conv's channels_last int8 output,
where torch 2.13's qnnpack clamp is wrong (every MobileNetV2 block). Eager convert runs it on the
dequantized values instead, as graph mode keeps it in reference form; the converted model answers
like the reference backend's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.analysis import sqnr
from qplug_core.eager import DeQuantStub, QuantStub

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class ConvReLU6Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.act = nn.ReLU6()
        self.conv2 = nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.conv2(self.act(self.conv(self.quant(x)))))


def _converted(backend: str, x: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    observed = qp.eager.prepare(ConvReLU6Net().eval(), backend=backend)
    with torch.no_grad():
        observed(x)
    return qp.eager.convert(observed)


def test_relu6_after_a_conv_on_qnnpack_answers_like_the_reference_backend():
    x = 2 * torch.randn(4, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = _converted("reference", x)(x)
        on_qnnpack = _converted("qnnpack", x)(x)
    assert sqnr(reference, on_qnnpack) > 30  # torch's clamp on channels_last: 0.1 dB
