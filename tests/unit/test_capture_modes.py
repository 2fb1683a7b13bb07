"""Capture keeps every module's train/eval mode (issue 27: Hugging Face EfficientNet, all in eval
mode, failed static quantization with "needs eval-mode modules").

Symbolic tracing goes through a ``Conv2d`` subclass defined outside ``torch.nn``; GraphModule then
holds its weight in a fresh holder module and normalization turns the functional conv into a fresh
``nn.Conv2d``: both started in training mode, so folding the BatchNorm after it was refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp


class DepthwiseConv(nn.Conv2d):
    """As transformers' EfficientNetDepthwiseConv2d: a Conv2d subclass, so tracing goes inside."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = DepthwiseConv(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


def test_an_eval_model_traced_through_a_conv_subclass_fuses_and_quantizes():
    torch.manual_seed(0)
    model = Block().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    data = [(torch.randn(2, 8, 6, 6),) for _ in range(3)]
    fused = qp.fuse_fx(model, data[0], backend="reference")
    assert not any(m.training for m in fused.modules())
    quantized = qp.quantize(model, data[0], data, backend="reference")
    assert qp.quantization_report(quantized).quantized
    assert qp.sqnr(quantized(*data[0]), model(*data[0])) > 25
