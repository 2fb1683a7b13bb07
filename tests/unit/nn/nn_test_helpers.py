"""Test doubles for the nn tests: a switchable weight fake quant and an embedding fake quant."""

from __future__ import annotations

import torch
from torch import nn


class SwitchableFakeQuant(nn.Module):
    """Per-tensor symmetric int8 fake quant of its input; identity while ``enabled`` is False.

    Stands in for the observers package's FakeQuantize so these tests exercise only the nn modules;
    the rounding is torch's own ``fake_quantize_per_tensor_affine`` (straight-through gradient).
    """

    enabled = True

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if not type(self).enabled:
            return w
        scale = float(w.detach().abs().max()) / 127 or 1.0
        return torch.fake_quantize_per_tensor_affine(w, scale, 0, -128, 127)


class RowFloatQParamsFakeQuant(nn.Module):
    """Embedding-style fake quant: quint8 per row with float qparams (min/max of each row)."""

    qscheme = torch.per_channel_affine_float_qparams

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        lo, hi = w.detach().min(1).values, w.detach().max(1).values
        scale = ((hi - lo) / 255).clamp_min(1e-8)
        zero_point = -lo / scale
        return torch.fake_quantize_per_channel_affine(w, scale, zero_point, 0, 0, 255)
