"""ONNX translations of ``torch.ops.qplug.*`` (QuantizeLinear / DequantizeLinear).

Mirrors onnxscript's translations of PT2E's ``quantized_decomposed`` ops, with two differences that
keep ONNX Runtime's QDQ fusions applicable: the reference form always quantizes to the storage
dtype's full range (``Quantize`` saturates there), so no ``Clip`` follows QuantizeLinear; and a range
narrower than the dtype's is refused instead of approximated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from onnxscript import ir
from onnxscript.onnx_opset import opset18 as op

from qplug_core.errors import ExportError

_FULL_RANGE = {ir.DataType.UINT8: (0, 255), ir.DataType.INT8: (-128, 127),
               ir.DataType.INT32: (-(2**31), 2**31 - 1)}


def _onnx_dtype(dtype: Any) -> ir.DataType:
    if isinstance(dtype, torch.dtype):
        return ir.DataType.from_numpy(torch.empty((), dtype=dtype).numpy().dtype)
    return ir.DataType(int(dtype))


def _check_full_range(quant_min: int, quant_max: int, dtype: ir.DataType) -> None:
    if _FULL_RANGE.get(dtype) != (quant_min, quant_max):
        raise ExportError(f"QuantizeLinear saturates to the full range of {dtype.name}, but the model "
                          f"quantizes to [{quant_min}, {quant_max}]; only full-range quantize ops "
                          "export exactly")


def quantize_per_tensor(input, scale, zero_point, quant_min: int, quant_max: int, dtype):
    dtype = _onnx_dtype(dtype)
    _check_full_range(quant_min, quant_max, dtype)
    return op.QuantizeLinear(input, op.Cast(scale, to=ir.DataType.FLOAT), op.Cast(zero_point, to=dtype))


def dequantize_per_tensor(input, scale, zero_point, quant_min: int, quant_max: int, dtype):
    dtype = _onnx_dtype(dtype)
    return op.DequantizeLinear(input, op.Cast(scale, to=ir.DataType.FLOAT), op.Cast(zero_point, to=dtype))


def quantize_per_channel(input, scales, zero_points, axis: int, quant_min: int, quant_max: int, dtype):
    dtype = _onnx_dtype(dtype)
    _check_full_range(quant_min, quant_max, dtype)
    return op.QuantizeLinear(input, op.Cast(scales, to=ir.DataType.FLOAT),
                             op.Cast(zero_points, to=dtype), axis=axis)


def dequantize_per_channel(input, scales, zero_points, axis: int, quant_min: int, quant_max: int,
                           dtype):
    dtype = _onnx_dtype(dtype)
    return op.DequantizeLinear(input, op.Cast(scales, to=ir.DataType.FLOAT),
                               op.Cast(zero_points, to=dtype), axis=axis)


def dynamic_fake_quantize(input, quant_min: int, quant_max: int, dtype):
    dtype = _onnx_dtype(dtype)
    if (dtype, quant_min, quant_max) != (ir.DataType.UINT8, 0, 255):
        raise ExportError(f"ONNX's DynamicQuantizeLinear quantizes to uint8 [0, 255]; the model's "
                          f"dynamic activations use {dtype.name} [{quant_min}, {quant_max}]")
    quantized, scale, zero_point = op.DynamicQuantizeLinear(input)
    return op.DequantizeLinear(quantized, scale, zero_point)


def dynamic_quantized_linear(input, weight_t, weight_scale, bias=None):
    """The form ONNX Runtime fuses into DynamicQuantizeMatMul (what its quantize_dynamic emits)."""
    quantized, scale, zero_point = op.DynamicQuantizeLinear(input)
    product = op.Cast(op.MatMulInteger(quantized, weight_t, zero_point), to=ir.DataType.FLOAT)
    out = op.Mul(product, op.Mul(scale, op.Cast(weight_scale, to=ir.DataType.FLOAT)))
    return out if bias is None else op.Add(out, bias)


def translation_table() -> dict[Callable, Callable]:
    """``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)``."""
    ops = torch.ops.qplug
    return {ops.quantize_per_tensor.default: quantize_per_tensor,
            ops.dequantize_per_tensor.default: dequantize_per_tensor,
            ops.quantize_per_channel.default: quantize_per_channel,
            ops.dequantize_per_channel.default: dequantize_per_channel,
            ops.dynamic_fake_quantize.default: dynamic_fake_quantize,
            ops.dynamic_quantized_linear.default: dynamic_quantized_linear}
