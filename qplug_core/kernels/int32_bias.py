"""The weight scale at which a layer's int32 bias and its dot products fit int32 together.

Integer kernels (qnnpack; ONNX Runtime's QLinearConv / QGemm and OpenVINO, fed by qplug's ONNX
export) add the bias to the int32 accumulator as ``round(b / (s_in * s_w))``. A pruned or tiny
channel (``s_w`` = eps) or a large bias leaves int32: the bias wraps or saturates, and even a bias
that fits can overflow once the dot product ``sum((x_q - zp_x) * (w_q - zp_w))`` is added. So the
weight scale of such a channel is raised until ``|bias_q| + max|x_q - zp_x| * sum|w_q - zp_w|``
fits (the onnxruntime fix, with headroom). The needed scale is ``|b| / (s_in * room)``, so the
coarser weights add about ``K * |b| / 2**31`` to the output, far below one step of an output
range that holds ``b``.
Convert applies it to every static layer (the reference form then computes what the integer
kernels do), and qnnpack's kernels and the ONNX export check it again for models built otherwise.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from qplug_core import qparams as Q
from qplug_core.kernels._common import INT32_MAX

_TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
#: float32 rounding of the scales and of ``b * (1 / scale)`` stays far below this
_MARGIN = 1 + 1e-6


def _dot_product_bound(weight: torch.Tensor, weight_qp: Q.QParams, input_qp: Q.QParams,
                       output_axis: int) -> torch.Tensor:
    """Per output channel, the largest ``|sum((x_q - zp_x) * (w_q - zp_w))|`` any input can give.

    Raising the weight scale only shrinks each ``|w_q - zp_w|``, so the bound holds after it."""
    levels = Q.quantize_in_slices(weight, weight_qp)
    zero_point = weight_qp.zero_point.to(torch.int16)  # |q - zp| <= 255: int16, not 4x the bytes in int64
    if weight_qp.per_channel:
        shape = [1] * weight.dim()
        shape[weight_qp.axis % weight.dim()] = -1
        zero_point = zero_point.reshape(shape)
    steps = (levels.to(torch.int16) - zero_point).abs()
    others = [d for d in range(weight.dim()) if d != output_axis]
    sums = steps.sum(dim=others, dtype=torch.int64) if others else steps.to(torch.int64)
    input_zero_point = int(input_qp.zero_point)
    widest_input = max(input_qp.quant_max - input_zero_point, input_zero_point - input_qp.quant_min)
    return sums.double() * widest_input


def fit_bias(layer: nn.Module, weight_qp: Q.QParams, input_qp: Q.QParams) -> tuple[Q.QParams, int]:
    """``weight_qp`` with the scale of each output channel of ``layer`` (a linear or a conv, its
    ``weight`` and ``bias``) raised just enough that its int32 bias plus its largest dot product
    fits int32 (all channels alike for per-tensor weights), and how many scales were raised (0:
    ``weight_qp`` itself). ``input_qp``: the layer's per-tensor input qparams."""
    bias, weight = getattr(layer, "bias", None), layer.weight
    if not isinstance(bias, torch.Tensor) or weight_qp.dtype not in (torch.quint8, torch.qint8) \
            or weight_qp.zero_point.is_floating_point():
        return weight_qp, 0
    output_axis = 1 if isinstance(layer, _TRANSPOSED_CONVS) else 0
    room = (INT32_MAX - _dot_product_bound(weight, weight_qp, input_qp, output_axis)).clamp_min(1.0)
    if room.numel() != bias.numel():  # a grouped transposed conv: its weight holds out / groups
        room = room.min()
    needed = bias.detach().abs().double() / (float(input_qp.scale) * room) * _MARGIN
    scale = weight_qp.scale.double()
    if not (weight_qp.per_channel and weight_qp.axis % weight.dim() == output_axis):
        needed = needed.max()
    raised = torch.maximum(scale, needed).to(torch.float32)
    changed = int((raised.double() > scale).sum())
    if not changed:
        return weight_qp, 0
    return dataclasses.replace(weight_qp, scale=raised.reshape(weight_qp.scale.shape)), changed


def overflow_note(layer: str, changed: int) -> str:
    """The warning when :func:`fit_bias` raised weight scales of ``layer``."""
    return (f"qplug: layer {layer!r}: int32 bias would overflow with the dot product added (b / (input scale "
            f"* weight scale) too large for integer kernels); raised the weight scale of {changed} "
            "output channel(s) until it fits (a pruned channel with a bias, or a very large bias, does "
            "this; the coarser weights move the output by far less than one step)")


__all__ = ["fit_bias", "overflow_note"]
