"""A per-channel multiply: where SmoothQuant divides a linear layer's input by its smoothing scales.

``x * inverse_scale`` on the last dimension, paired with the next layer's weight columns
multiplied by the scale, leaves the float function unchanged while moving activation outliers
into the weights (Xiao et al., "SmoothQuant", ICML 2023).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ChannelScale"]


class ChannelScale(nn.Module):
    """``x * inverse_scale`` over the last dimension of ``x``."""

    def __init__(self, inverse_scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("inverse_scale", inverse_scale.detach().clone().float().flatten())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inverse_scale

    def extra_repr(self) -> str:
        return f"channels={self.inverse_scale.numel()}"
