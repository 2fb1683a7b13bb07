"""QuantStub / DeQuantStub: where an eager-mode model enters and leaves int8.

Eager mode has no graph, so the user marks the float -> int8 and int8 -> float boundaries with
these identity modules; prepare observes the QuantStub's output and convert swaps both for the
backend's quantize / dequantize kernels (torch.ao semantics, our own code).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _Stub(nn.Module):
    """Identity in float; an optional ``qconfig`` attribute wins over the QConfigMapping for it
    (as ``torch.ao.quantization.QuantStub(qconfig)`` does)."""

    def __init__(self, qconfig: Any = None) -> None:
        super().__init__()
        if qconfig is not None:
            self.qconfig = qconfig

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class QuantStub(_Stub):
    """Where float enters int8: observed at prepare, the backend's Quantize after convert."""


class DeQuantStub(_Stub):
    """Where int8 leaves for float: the backend's Dequantize after convert (never observed)."""
