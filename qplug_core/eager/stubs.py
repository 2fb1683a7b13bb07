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


class QuantWrapper(nn.Module):
    """``module`` between a QuantStub and a DeQuantStub: the whole module runs in int8.

    The stubs take the wrapped module's ``qconfig`` attribute, if it has one (torch.ao's
    ``QuantWrapper``).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        qconfig = getattr(module, "qconfig", None)
        self.add_module("quant", QuantStub(qconfig))
        self.add_module("dequant", DeQuantStub(qconfig))
        self.add_module("module", module)
        self.train(module.training)

    def forward(self, x: Any) -> Any:
        return self.dequant(self.module(self.quant(x)))
