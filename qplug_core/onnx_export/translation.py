"""ONNX translations of ``torch.ops.qplug.*`` (QuantizeLinear / DequantizeLinear), and the ATen
ops qplug translates itself (:mod:`~qplug_core.onnx_export.aten_ops`).

Mirrors onnxscript's translations of PT2E's ``quantized_decomposed`` ops, with two differences that
keep ONNX Runtime's QDQ fusions applicable: the reference form always quantizes to the storage
dtype's full range (``Quantize`` saturates there), so no ``Clip`` follows QuantizeLinear; and a range
narrower than the dtype's is refused instead of approximated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from onnx.defs import OpSchema
from onnxscript import ir
from onnxscript.onnx_opset import opset18 as op
from onnxscript.values import Op, Opset

from qplug_core.errors import ExportError
from qplug_core.onnx_export import aten_ops


def _dynamic_quantize_lstm_schema() -> OpSchema:
    """ONNX Runtime's com.microsoft DynamicQuantizeLSTM (onnx ships no schema for contrib ops),
    as far as the exporter needs it to record the node: inputs, outputs, types, attributes."""
    param = OpSchema.FormalParameter
    optional = OpSchema.FormalParameterOption.Optional
    inputs = [param("X", "T"), param("W", "T2"), param("R", "T2"), param("B", "T", param_option=optional),
              param("sequence_lens", "T1", param_option=optional),
              param("initial_h", "T", param_option=optional), param("initial_c", "T", param_option=optional),
              param("P", "T", param_option=optional), param("W_scale", "T"), param("W_zero_point", "T2"),
              param("R_scale", "T"), param("R_zero_point", "T2")]
    outputs = [param(name, "T", param_option=optional) for name in ("Y", "Y_h", "Y_c")]
    attributes = [OpSchema.Attribute("direction", OpSchema.AttrType.STRING, required=False),
                  OpSchema.Attribute("hidden_size", OpSchema.AttrType.INT, required=False)]
    return OpSchema("DynamicQuantizeLSTM", "com.microsoft", 1, inputs=inputs, outputs=outputs,
                    type_constraints=[("T", ["tensor(float)"], ""), ("T1", ["tensor(int32)"], ""),
                                      ("T2", ["tensor(int8)", "tensor(uint8)"], "")],
                    attributes=attributes)


_DYNAMIC_QUANTIZE_LSTM = Op(Opset("com.microsoft", 1), "DynamicQuantizeLSTM", _dynamic_quantize_lstm_schema())

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


def dequantized_weight_linear(input, weight_t, weight_scale, bias=None):
    """A dynamic linear for a runtime that quantizes activations itself: the float input times
    the int8 weights behind a DequantizeLinear (per output channel). OpenVINO compiles that
    into a compressed-weight FullyConnected and, with ``DYNAMIC_QUANTIZATION_GROUP_SIZE``,
    quantizes the input per group of that many features at run time: finer than the reference
    form's one scale per tensor, and int8 products where ``MatMulInteger`` gains nothing there."""
    weight = op.DequantizeLinear(weight_t, op.Cast(weight_scale, to=ir.DataType.FLOAT), axis=1)
    out = op.MatMul(input, weight)
    return out if bias is None else op.Add(out, bias)


def dynamic_quantized_lstm(input, weight_t, weight_scale, recurrent_t, recurrent_scale, bias, initial_h,
                           initial_c):
    """ONNX Runtime's DynamicQuantizeLSTM (the op its quantize_dynamic emits), with the int8
    weights as given and zero points 0: no standard ONNX op quantizes an LSTM."""
    directions, hidden = weight_t.shape[0], recurrent_t.shape[1]
    zero_points = op.Constant(value=ir.tensor(np.zeros((directions, 4 * hidden), dtype=np.int8)))
    return _DYNAMIC_QUANTIZE_LSTM(
        input, weight_t, recurrent_t, bias, None, initial_h, initial_c, None, weight_scale, zero_points,
        recurrent_scale, zero_points, hidden_size=hidden,
        direction="bidirectional" if directions == 2 else "forward")


#: how a dynamic int8 linear is exported: ONNX Runtime's fused form, or int8 weights into a float
#: MatMul for a runtime that quantizes the activations itself (:func:`dequantized_weight_linear`)
DYNAMIC_LINEAR_FORMS = ("matmul_integer", "dequantized_weights")


def translation_table(dynamic_linears: str = "matmul_integer") -> dict[Callable, Callable]:
    """``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)``; ``dynamic_linears``
    is one of :data:`DYNAMIC_LINEAR_FORMS`."""
    if dynamic_linears not in DYNAMIC_LINEAR_FORMS:
        raise ExportError(f"dynamic_linears must be one of {', '.join(DYNAMIC_LINEAR_FORMS)}, "
                          f"got {dynamic_linears!r}")
    linear = dynamic_quantized_linear if dynamic_linears == "matmul_integer" else dequantized_weight_linear
    ops = torch.ops.qplug
    return {ops.quantize_per_tensor.default: quantize_per_tensor,
            ops.dequantize_per_tensor.default: dequantize_per_tensor,
            ops.quantize_per_channel.default: quantize_per_channel,
            ops.dequantize_per_channel.default: dequantize_per_channel,
            ops.dynamic_fake_quantize.default: dynamic_fake_quantize,
            ops.dynamic_quantized_linear.default: linear,
            ops.dynamic_quantized_lstm.default: dynamic_quantized_lstm, **aten_ops.translation_table()}
