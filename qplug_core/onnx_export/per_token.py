"""Per-token dynamic int8 linears (an accuracy target's fallback) as standard ONNX ops.

:class:`~qplug_core.kernels.per_token.PerTokenDynamicLinear` runs oneDNN's packed kernel, which the
exporter cannot trace, and ONNX's ``DynamicQuantizeLinear`` has one scale per tensor, not per
token. :class:`PerTokenQuantizedLinear` writes the layer's own arithmetic with ordinary ops instead
(ReduceMin/ReduceMax per row, Round, the int8 weight behind ``DequantizeLinear``, MatMul), so a
runtime computes the numbers the PyTorch model does, to float rounding.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from qplug_core import qparams as Q
from qplug_core.ir.qdq_ops import dequantize_op
from qplug_core.kernels.per_token import LEVELS, PerTokenDynamicLinear
from qplug_core.kernels.reference import _QParamsHolder

__all__ = ["PerTokenQuantizedLinear", "with_per_token_ops"]

_EPS = torch.finfo(torch.float32).eps  # the kernel's smallest token range


class PerTokenQuantizedLinear(nn.Module):
    """``PerTokenDynamicLinear``'s computation in exportable ops: each row of the input on its own
    asymmetric grid of :data:`LEVELS` steps (0 included), times the per-channel int8 weight."""

    def __init__(self, layer: PerTokenDynamicLinear):
        super().__init__()
        self.register_buffer("qweight", layer.weight_int8_t.t().contiguous())
        scale = layer.weight_scale.detach().clone()
        self.weight_qparams = _QParamsHolder(Q.QParams(scale, torch.zeros_like(scale, dtype=torch.int64),
                                                       torch.qint8, -128, 127, axis=0))
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        low = x.amin(dim=-1, keepdim=True).clamp_max(0)
        high = x.amax(dim=-1, keepdim=True).clamp_min(0)
        inverse = 1.0 / ((high - low).clamp_min(_EPS) / LEVELS)
        zero_point = torch.round(low * inverse)
        dequantized = (torch.round(x * inverse - zero_point) + zero_point) / inverse
        weight = dequantize_op(self.qweight, self.weight_qparams.qparams)
        return nn.functional.linear(dequantized, weight, self.bias)


def with_per_token_ops(gm: fx.GraphModule) -> None:
    """Replace, in place, every per-token dynamic linear of ``gm`` (a copy made for export) by
    :class:`PerTokenQuantizedLinear`; the ones inside a fused ``LinearReLU`` keep their ReLU."""
    for name, module in list(gm.named_modules()):
        if isinstance(module, PerTokenDynamicLinear):
            gm.set_submodule(name, PerTokenQuantizedLinear(module))
