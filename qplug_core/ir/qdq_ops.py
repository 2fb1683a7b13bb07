"""The reference form's quantize/dequantize as torch operators: ``torch.ops.qplug.*``.

``Quantize``/``Dequantize`` modules call these, so a captured reference model (``torch.export``,
``torch.onnx.export(dynamo=True)``, ``torch.compile``) sees one operator per boundary, with its
qparams as tensor arguments (buffers in the graph) instead of a dozen elementwise ops:

- ``qplug::quantize_per_tensor(Tensor input, Tensor scale, Tensor zero_point, int quant_min,
  int quant_max, ScalarType dtype) -> Tensor``
- ``qplug::dequantize_per_tensor(Tensor input, Tensor scale, Tensor zero_point, int quant_min,
  int quant_max, ScalarType dtype) -> Tensor``
- ``qplug::quantize_per_channel(Tensor input, Tensor scales, Tensor zero_points, int axis,
  int quant_min, int quant_max, ScalarType dtype) -> Tensor``
- ``qplug::dequantize_per_channel(...)`` with the same arguments;
- ``qplug::dynamic_fake_quantize(Tensor input, int quant_min, int quant_max, ScalarType dtype)``:
  run-time (dynamic) activation quantization, qparams from the tensor's own min/max;
- ``qplug::dynamic_quantized_linear(Tensor input, Tensor weight_t, Tensor weight_scale,
  Tensor? bias)``: a dynamic int8 linear (symmetric int8 weights, transposed) as one node;
- ``qplug::dynamic_quantized_lstm(Tensor input, Tensor weight_t, Tensor weight_scale,
  Tensor recurrent_t, Tensor recurrent_scale, Tensor bias, Tensor? initial_h, Tensor? initial_c)
  -> (Tensor, Tensor, Tensor)``: one layer of a dynamic int8 LSTM in ONNX's layout, as one node
  (ONNX Runtime: ``com.microsoft.DynamicQuantizeLSTM``).

The semantics are PT2E's ``quantized_decomposed`` ops (``dtype`` is the storage dtype,
``torch.uint8`` / ``torch.int8`` / ``torch.int32``; quantize rounds half to even, adds the zero
point and clamps to ``[quant_min, quant_max]``; dequantize ignores the range), computed by
:mod:`qplug_core.qparams`, so the numbers are those of every other qplug code path.

Why a namespace of our own: torch defines ``quantized_decomposed`` only in
``torch.ao.quantization.fx._decomposed``; importing it pulls in the deprecated torch.ao FX package,
which runtime code must not import, and defining that namespace here would clash with torch's
definition (a second ``TORCH_LIBRARY``) as soon as torch._inductor imports it. ONNX export maps
these ops to QuantizeLinear/DequantizeLinear through a custom translation table
(:mod:`qplug_core.onnx_export`).

Why not ``torch.library.custom_op``: it wraps each kernel in ``torch._disable_dynamo``, which
imports ``torch._dynamo`` (with sympy, torch.distributed...) at the op's first call, seconds before
the first answer of a reference model in a fresh process. :func:`_operator` registers the same
schema, tag, kernel and autograd entry through ``torch.library`` without that wrapper.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from qplug_core import qparams as Q
from qplug_core.errors import InputMismatchError, ModelStateError

#: storage dtype -> quantized dtype identifier (the inverse of ``qparams.STORAGE_DTYPE``)
QUANTIZED_DTYPE = {storage: quantized for quantized, storage in Q.STORAGE_DTYPE.items()}

_LIB = torch.library.Library("qplug", "DEF")
_Fn = TypeVar("_Fn", bound=Callable[..., object])


def _operator(fn: _Fn) -> _Fn:
    """Define ``qplug::<fn's name>`` with the schema of ``fn``'s annotations, computed by ``fn`` on
    every device (its fake kernel is registered beside it with ``torch.library.register_fake``)."""
    name = fn.__name__
    _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()),
                tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, fn, "CompositeExplicitAutograd")

    def backward(ctx, *grads):
        raise ModelStateError(f"qplug::{name} has no gradient: the reference form is for inference "
                              "(train with qp.prepare_qat_fx, whose fake quantization has one)")

    torch.library.register_autograd(f"qplug::{name}", backward, lib=_LIB)
    return fn


def _qparams(scale: Tensor, zero_point: Tensor, dtype: torch.dtype, quant_min: int, quant_max: int,
             axis: int | None) -> Q.QParams:
    return Q.QParams(scale, zero_point, QUANTIZED_DTYPE[dtype], quant_min, quant_max, axis)


@_operator
def quantize_per_tensor(input: Tensor, scale: Tensor, zero_point: Tensor, quant_min: int,
                        quant_max: int, dtype: torch.dtype) -> Tensor:
    return Q.quantize(input, _qparams(scale, zero_point, dtype, quant_min, quant_max, None))


@_operator
def dequantize_per_tensor(input: Tensor, scale: Tensor, zero_point: Tensor, quant_min: int,
                          quant_max: int, dtype: torch.dtype) -> Tensor:
    return Q.dequantize(input, _qparams(scale, zero_point, dtype, quant_min, quant_max, None))


@_operator
def quantize_per_channel(input: Tensor, scales: Tensor, zero_points: Tensor, axis: int,
                         quant_min: int, quant_max: int, dtype: torch.dtype) -> Tensor:
    return Q.quantize(input, _qparams(scales, zero_points, dtype, quant_min, quant_max, axis))


@_operator
def dequantize_per_channel(input: Tensor, scales: Tensor, zero_points: Tensor, axis: int,
                           quant_min: int, quant_max: int, dtype: torch.dtype) -> Tensor:
    return Q.dequantize(input, _qparams(scales, zero_points, dtype, quant_min, quant_max, axis))


def refuse_nonfinite_input(x: Tensor, where: str, summary: Tensor) -> None:
    """Raise when ``x``, about to be quantized over its own range at inference, holds NaN or Inf.

    ``summary`` is a reduction of ``x`` the caller has or gets for one pass (its sum; min + max),
    finite whenever ``x`` is unless it overflowed, so the exact check runs only then. Without it,
    torch's kernels answered finite numbers for NaN (fbgemm), a wrong sign for Inf, or their own
    errors (qnnpack), and the reference form a calibration error.
    """
    if math.isfinite(float(summary)) or bool(torch.isfinite(x).all()):
        return
    bad = int((~torch.isfinite(x)).sum())
    raise InputMismatchError(
        f"{where} got an input with {bad} NaN or Inf value(s) among {x.numel()} at inference: dynamic "
        "int8 quantizes each input over its own range, which a non-finite value does not have (the "
        "float model would answer NaN or Inf). Check the data before the call (torch.isfinite(x).all())")


@_operator
def dynamic_fake_quantize(input: Tensor, quant_min: int, quant_max: int, dtype: torch.dtype) -> Tensor:
    """Per-call (dynamic) activation quantization, simulated: qparams from this tensor's min/max
    (affine, 0 included), then quantize and dequantize; what dynamic int8 kernels do inside."""
    if input.numel() == 0:
        return input.clone()
    qdtype = QUANTIZED_DTYPE[dtype]
    low, high = input.detach().min(), input.detach().max()
    refuse_nonfinite_input(input, "a dynamic int8 layer", low + high)
    scale, zero_point = Q.compute_qparams(
        low, high, dtype=qdtype, qscheme=torch.per_tensor_affine,
        quant_min=quant_min, quant_max=quant_max, eps=torch.finfo(torch.float32).eps)
    return Q.fake_quantize(input, Q.QParams(scale, zero_point, qdtype, quant_min, quant_max))


@_operator
def dynamic_quantized_linear(input: Tensor, weight_t: Tensor, weight_scale: Tensor,
                             bias: Tensor | None) -> Tensor:
    """``linear(dynamic_fake_quantize(input), dequantize(weight))`` with symmetric int8 weights
    stored transposed (``[in, out]``) and one scale per output channel (or one for all): the
    reference numbers of a dynamic int8 linear, as one node (ONNX: MatMulInteger and rescale)."""
    x = dynamic_fake_quantize(input, 0, 255, torch.uint8)
    weight = weight_t.to(torch.float32) * weight_scale.to(torch.float32)
    return torch.nn.functional.linear(x, weight.t(), bias)


@_operator
def dynamic_quantized_lstm(input: Tensor, weight_t: Tensor, weight_scale: Tensor, recurrent_t: Tensor,
                           recurrent_scale: Tensor, bias: Tensor, initial_h: Tensor | None,
                           initial_c: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """One LSTM layer (one or two directions) with symmetric int8 weights, in ONNX's layout: input
    ``[seq, batch, in]``, ``weight_t`` ``[dirs, in, 4h]`` and ``recurrent_t`` ``[dirs, h, 4h]``
    (transposed, gates in ONNX's order i, o, f, c) with scales ``[dirs, 4h]``, ``bias``
    ``[dirs, 8h]`` (input then recurrent), states ``[dirs, batch, h]`` (None: zeros); returns ``Y``
    ``[seq, dirs, batch, h]`` and the last ``h``, ``c``.

    The numbers of ONNX Runtime's DynamicQuantizeLSTM, which the int8 LSTM kernels share: the
    layer's whole input is quantized once (uint8, its own min/max), the hidden state again at
    every step. (The reference form keeps the state float; see ``SimulatedDynamic``.)
    """
    x = dynamic_fake_quantize(input, 0, 255, torch.uint8)
    hidden = recurrent_t.shape[1]
    ys, hs, cs = [], [], []
    for d in range(weight_t.shape[0]):
        w = weight_t[d].to(torch.float32) * weight_scale[d].to(torch.float32)
        r = recurrent_t[d].to(torch.float32) * recurrent_scale[d].to(torch.float32)
        gates_x = x @ w + bias[d, : 4 * hidden]
        zeros = input.new_zeros((input.shape[1], hidden), dtype=torch.float32)
        h = zeros if initial_h is None else initial_h[d]
        c = zeros if initial_c is None else initial_c[d]
        steps = range(input.shape[0] - 1, -1, -1) if d == 1 else range(input.shape[0])
        out = [h] * input.shape[0]
        for t in steps:
            gates = gates_x[t] + dynamic_fake_quantize(h, 0, 255, torch.uint8) @ r + bias[d, 4 * hidden:]
            i, o, f, g = gates.chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            out[t] = h
        ys.append(torch.stack(out))
        hs.append(h)
        cs.append(c)
    return torch.stack(ys, 1), torch.stack(hs), torch.stack(cs)


@torch.library.register_fake("qplug::dynamic_quantized_lstm", lib=_LIB)
def _(input, weight_t, weight_scale, recurrent_t, recurrent_scale, bias, initial_h, initial_c):
    dirs, hidden = weight_t.shape[0], recurrent_t.shape[1]
    state = input.new_empty((dirs, input.shape[1], hidden), dtype=torch.float32)
    return (input.new_empty((input.shape[0], dirs, input.shape[1], hidden), dtype=torch.float32),
            state, torch.empty_like(state))


@torch.library.register_fake("qplug::dynamic_quantized_linear", lib=_LIB)
def _(input, weight_t, weight_scale, bias):
    return input.new_empty((*input.shape[:-1], weight_t.shape[1]), dtype=torch.float32)


@torch.library.register_fake("qplug::dynamic_fake_quantize", lib=_LIB)
def _(input, quant_min, quant_max, dtype):
    return torch.empty_like(input, dtype=torch.float32)


@torch.library.register_fake("qplug::quantize_per_tensor", lib=_LIB)
def _(input, scale, zero_point, quant_min, quant_max, dtype):
    return torch.empty_like(input, dtype=dtype)


@torch.library.register_fake("qplug::quantize_per_channel", lib=_LIB)
def _(input, scales, zero_points, axis, quant_min, quant_max, dtype):
    return torch.empty_like(input, dtype=dtype)


@torch.library.register_fake("qplug::dequantize_per_tensor", lib=_LIB)
def _(input, scale, zero_point, quant_min, quant_max, dtype):
    return torch.empty_like(input, dtype=torch.float32)


@torch.library.register_fake("qplug::dequantize_per_channel", lib=_LIB)
def _(input, scales, zero_points, axis, quant_min, quant_max, dtype):
    return torch.empty_like(input, dtype=torch.float32)


def quantize_op(x: Tensor, qp: Q.QParams) -> Tensor:
    """``torch.ops.qplug.quantize_per_*`` of ``x`` with ``qp`` (integer zero points only)."""
    dtype = Q.STORAGE_DTYPE[qp.dtype]
    if qp.axis is None:
        return torch.ops.qplug.quantize_per_tensor(x, qp.scale, qp.zero_point, qp.quant_min,
                                                   qp.quant_max, dtype)
    return torch.ops.qplug.quantize_per_channel(x, qp.scale, qp.zero_point, qp.axis, qp.quant_min,
                                                qp.quant_max, dtype)


def dequantize_op(q: Tensor, qp: Q.QParams) -> Tensor:
    """``torch.ops.qplug.dequantize_per_*`` of ``q`` with ``qp`` (integer zero points only)."""
    dtype = Q.STORAGE_DTYPE[qp.dtype]
    if qp.axis is None:
        return torch.ops.qplug.dequantize_per_tensor(q, qp.scale, qp.zero_point, qp.quant_min,
                                                     qp.quant_max, dtype)
    return torch.ops.qplug.dequantize_per_channel(q, qp.scale, qp.zero_point, qp.axis,
                                                  qp.quant_min, qp.quant_max, dtype)
