"""A clamp with one upper bound per channel: what ReLU6 becomes after cross-layer equalization.

Equalization divides a conv's output channel ``i`` by ``s_i``. ReLU and identity commute with that
(``relu(x / s) == relu(x) / s`` for ``s > 0``), but a clamp at 6 does not: ``min(x / s, 6)`` is not
``min(x, 6) / s``. Clamping channel ``i`` at ``6 / s_i`` instead is exact, so the equalized model
computes the same function as the original.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ChannelClamp"]


class ChannelClamp(nn.Module):
    """``clamp(x, lower, upper[c])`` with ``upper`` given per channel (``channel_dim`` of ``x``)."""

    def __init__(self, upper: torch.Tensor, lower: float = 0.0, channel_dim: int = 1) -> None:
        super().__init__()
        self.register_buffer("upper", upper.detach().clone().float().flatten())
        self.lower = float(lower)
        self.channel_dim = int(channel_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = [1] * x.dim()
        shape[self.channel_dim] = -1
        return torch.minimum(x.clamp_min(self.lower), self.upper.view(shape))

    def extra_repr(self) -> str:
        return f"lower={self.lower}, channels={self.upper.numel()}, channel_dim={self.channel_dim}"
