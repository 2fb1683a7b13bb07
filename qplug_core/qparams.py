"""Quantization parameters and the affine quantization maths on plain tensors.

Quantized values are stored in ordinary integer tensors (``torch.uint8`` for quint8, ``torch.int8``
for qint8, ``torch.int32`` for qint32) so that the core never creates deprecated torch quantized
tensors; only backend kernels do, inside their own modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qplug_core.errors import ConfigValidationError, NonFiniteCalibrationError

#: storage dtype of each quantized dtype identifier
STORAGE_DTYPE = {torch.quint8: torch.uint8, torch.qint8: torch.int8, torch.qint32: torch.int32}


@dataclass(frozen=True)
class QParams:
    """Everything needed to quantize or dequantize one tensor.

    ``scale`` is float32 and ``zero_point`` int64: 0-d for per-tensor, 1-d (one entry per channel
    along ``axis``) for per-channel. ``dtype`` is the quantized dtype identifier (``torch.quint8``,
    ``torch.qint8``, ``torch.qint32``) or ``torch.float16`` for fp16 weight-only quantization.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    dtype: torch.dtype
    quant_min: int
    quant_max: int
    axis: int | None = None
    is_dynamic: bool = False

    @property
    def per_channel(self) -> bool:
        return self.axis is not None


#: quantization schemes this module understands
PER_TENSOR_SCHEMES = (torch.per_tensor_affine, torch.per_tensor_symmetric)
PER_CHANNEL_SCHEMES = (torch.per_channel_affine, torch.per_channel_symmetric,
                       torch.per_channel_affine_float_qparams)
SYMMETRIC_SCHEMES = (torch.per_tensor_symmetric, torch.per_channel_symmetric)

#: full integer range of each quantized dtype (what its storage dtype can hold)
_DTYPE_RANGE = {torch.quint8: (0, 255), torch.qint8: (-128, 127), torch.qint32: (-(2**31), 2**31 - 1)}
_REDUCED_RANGE = {torch.quint8: (0, 127), torch.qint8: (-64, 63), torch.qint32: (-(2**31), 2**31 - 1)}


def is_per_channel(qscheme: torch.qscheme) -> bool:
    return qscheme in PER_CHANNEL_SCHEMES


def quant_range(dtype: torch.dtype, reduce_range: bool = False, quant_min: int | None = None,
                quant_max: int | None = None) -> tuple[int, int]:
    """Resolve the integer range ``(qmin, qmax)`` exactly as torch.ao's observers do.

    Without a custom range the dtype's 8-bit (or 32-bit) range is used, one bit smaller under
    ``reduce_range`` (quint8 0..127, qint8 -64..63; qint32 is never reduced). A custom range must
    contain 0, be non-empty and fit the dtype; ``reduce_range`` then halves it (floor division), as
    torch.ao does.
    """
    if dtype not in _DTYPE_RANGE:
        raise ConfigValidationError(
            f"quantized dtype {dtype} is not supported; use one of torch.quint8, torch.qint8, "
            "torch.qint32", field="dtype", value=dtype)
    if (quant_min is None) != (quant_max is None):
        raise ConfigValidationError(
            f"quant_min={quant_min} and quant_max={quant_max}: give both bounds or neither",
            field="quant_min" if quant_min is None else "quant_max",
            value=quant_min if quant_min is not None else quant_max)
    if quant_min is None or quant_max is None:
        return (_REDUCED_RANGE if reduce_range else _DTYPE_RANGE)[dtype]
    lo, hi = _DTYPE_RANGE[dtype]
    if quant_min >= quant_max:
        raise ConfigValidationError(
            f"quant_min={quant_min} must be smaller than quant_max={quant_max}",
            field="quant_min", value=quant_min)
    if not quant_min <= 0 <= quant_max:
        raise ConfigValidationError(
            f"the quantization range [{quant_min}, {quant_max}] must contain 0 so that zero is "
            "exactly representable", field="quant_min" if quant_min > 0 else "quant_max",
            value=(quant_min, quant_max))
    if quant_min < lo or quant_max > hi:
        raise ConfigValidationError(
            f"the quantization range [{quant_min}, {quant_max}] does not fit {dtype} "
            f"([{lo}, {hi}]); narrow the range or pick a wider dtype",
            field="quant_min" if quant_min < lo else "quant_max", value=(quant_min, quant_max))
    if reduce_range:
        return quant_min // 2, quant_max // 2
    return quant_min, quant_max


def compute_qparams(min_val: torch.Tensor, max_val: torch.Tensor, *, dtype: torch.dtype,
                    qscheme: torch.qscheme, quant_min: int, quant_max: int,
                    eps: float | torch.Tensor = torch.finfo(torch.float32).eps,
                    custom_range: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point for an observed range, bit-identical to torch.ao's observers.

    Works elementwise, so 0-d inputs give per-tensor and 1-d inputs per-channel qparams (same shape
    as ``min_val``). The range is widened to include 0 (so 0.0 quantizes exactly), the scale is
    floored at ``eps`` (constant inputs stay finite) and the zero point clamped into the range.
    ``custom_range`` says the user chose ``quant_min``/``quant_max``: symmetric quint8 then centres
    the zero point at ``(quant_min + quant_max) // 2`` instead of 128, as in torch.ao.
    ``per_channel_affine_float_qparams`` returns a float zero point (``-min / scale``), without
    including 0. Raises :class:`NonFiniteCalibrationError` when the scale would not be finite.
    """
    min_val = torch.as_tensor(min_val, dtype=torch.float32)
    max_val = torch.as_tensor(max_val, dtype=torch.float32)
    if bool((min_val > max_val).any()):
        raise ConfigValidationError(
            f"min_val {min_val.tolist()} is above max_val {max_val.tolist()}",
            field="min_val", value=min_val.tolist())
    eps_t = torch.as_tensor(eps, dtype=torch.float32, device=min_val.device).reshape(-1)[:1]
    eps_t = eps_t.reshape(()) if min_val.dim() == 0 else eps_t
    if qscheme == torch.per_channel_affine_float_qparams:
        scale = (max_val - min_val) / float(quant_max - quant_min)
        scale = torch.where(scale > eps_t, scale, torch.ones_like(scale))
        zero_point = -1 * min_val / scale
    else:
        min_neg = torch.min(min_val, torch.zeros_like(min_val))
        max_pos = torch.max(max_val, torch.zeros_like(max_val))
        if qscheme in SYMMETRIC_SCHEMES:
            max_pos = torch.max(-min_neg, max_pos)
            scale = torch.max(max_pos / (float(quant_max - quant_min) / 2), eps_t)
            mid = (quant_min + quant_max) // 2 if custom_range else 128
            zp = mid if dtype == torch.quint8 else 0
            zero_point = torch.full_like(scale, zp, dtype=torch.int64)
        elif qscheme in (torch.per_tensor_affine, torch.per_channel_affine):
            scale = torch.max((max_pos - min_neg) / float(quant_max - quant_min), eps_t)
            zero_point = quant_min - torch.round(min_neg / scale).to(torch.int64)
            zero_point = torch.clamp(zero_point, quant_min, quant_max)
        else:
            raise ConfigValidationError(f"unknown quantization scheme {qscheme}", field="qscheme",
                                        value=qscheme)
    bad = ~torch.isfinite(scale)
    if bool(bad.any()):
        raise NonFiniteCalibrationError(
            f"the observed range [{min_val.min().item():g}, {max_val.max().item():g}] gives a "
            "non-finite scale (range wider than float32 can express); clip the data or check it "
            "for overflow", count=int(bad.sum()))
    return scale, zero_point


def _broadcast(qp: QParams, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point shaped to broadcast against ``x`` along ``qp.axis``."""
    scale = qp.scale.to(device=x.device, dtype=torch.float32)
    zero_point = qp.zero_point.to(x.device)
    if qp.axis is None:
        if scale.numel() != 1 or zero_point.numel() != 1:
            raise ConfigValidationError(
                f"per-tensor qparams need one scale and zero point, got {scale.numel()}",
                field="scale", value=tuple(scale.shape))
        return scale.reshape(()), zero_point.reshape(())
    if not -x.dim() <= qp.axis < max(x.dim(), 1):
        raise ConfigValidationError(f"axis {qp.axis} is out of range for a {x.dim()}-d tensor",
                                    field="axis", value=qp.axis)
    axis = qp.axis % x.dim()
    if scale.numel() != x.shape[axis] or zero_point.numel() != x.shape[axis]:
        raise ConfigValidationError(
            f"{scale.numel()} scales / {zero_point.numel()} zero points for {x.shape[axis]} "
            f"channels along axis {axis}", field="scale", value=tuple(scale.shape))
    shape = [1] * x.dim()
    shape[axis] = -1
    return scale.reshape(shape), zero_point.reshape(shape)


def quantize_unclamped(x: torch.Tensor, qp: QParams
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rounded but unclamped quantized values in float32, plus the broadcast scale and zero point.

    Mirrors torch's kernels: multiply by ``1 / scale`` computed in float32, round half to even, add
    the zero point. Callers clamp in float, so huge inputs saturate instead of wrapping through an
    integer cast (torch's per-channel fake-quant wraps for |x / scale| > 2**31).
    """
    scale, zero_point = _broadcast(qp, x)
    scaled = x.to(torch.float32) * (1.0 / scale)
    # per_channel_affine_float_qparams, and qint32 as torch's kernels do it: zp added before rounding
    if zero_point.is_floating_point() or qp.dtype == torch.qint32:
        zero_point = zero_point.to(torch.float32)
        return torch.round(scaled + zero_point), scale, zero_point
    zero_point = zero_point.to(torch.float32)
    return torch.round(scaled) + zero_point, scale, zero_point


def quantize(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """Quantize ``x`` into a plain integer tensor of ``STORAGE_DTYPE[qp.dtype]``, saturating, as
    torch's ``quantize_per_tensor`` (fbgemm and qnnpack) does: NaN gives ``quant_max`` in 8 bits.

    qint32 values are clamped in float64, as torch's kernels do: in float32 the bound 2**31 - 1
    rounds up to 2**31, which the cast to int32 wraps to -2**31 (3e9 would become INT32_MIN).
    """
    q, _, _ = quantize_unclamped(x, qp)
    if qp.dtype == torch.qint32:
        q = q.double()
    else:
        q = q.nan_to_num(nan=float(qp.quant_max))
    return torch.clamp(q, qp.quant_min, qp.quant_max).to(STORAGE_DTYPE[qp.dtype])


def dequantize(q: torch.Tensor, qp: QParams) -> torch.Tensor:
    """Map stored integers back to float32: ``(q - zero_point) * scale``."""
    scale, zero_point = _broadcast(qp, q)
    if zero_point.is_floating_point():
        return (q.to(torch.float32) - zero_point) * scale
    return (q.to(torch.int64) - zero_point.to(torch.int64)).to(torch.float32) * scale


def slices(x: torch.Tensor, qp: QParams, elements: int = 1 << 20) -> tuple[torch.Tensor, ...]:
    """Views of ``x`` of about ``elements`` each, covering it, each with every channel of ``qp``'s axis:
    (fake-)quantizing them one at a time gives the values of ``x`` quantized whole, with temporaries
    of one slice (rounding BERT-base's 30522x768 embedding whole took 4x its bytes at once)."""
    axis = None if qp.axis is None else qp.axis % max(x.dim(), 1)
    dims = [d for d in range(x.dim()) if d != axis and x.shape[d] > 1]
    if not dims or x.numel() <= elements:
        return (x,)
    per_step = x.numel() // x.shape[dims[0]]
    return x.split(max(1, elements // max(per_step, 1)), dims[0])


def quantize_in_slices(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """:func:`quantize` of ``x``, a slice at a time (:func:`slices`): the same integers, with float
    temporaries of one slice. Whole, a weight's were four times its float bytes, and glibc kept
    the heap they grew (an export quantizing ViT-B/16's weights one by one rose 4x the model's)."""
    out = torch.empty(x.shape, dtype=STORAGE_DTYPE[qp.dtype])
    for part, x_part in zip(slices(out, qp), slices(x.detach(), qp)):
        part.copy_(quantize(x_part, qp))
    return out


class _FakeQuantizeSTE(torch.autograd.Function):
    """Fake quantization whose gradient passes straight through where the value is not clipped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, qp: QParams) -> torch.Tensor:
        q, scale, zero_point = quantize_unclamped(x, qp)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward((q >= qp.quant_min) & (q <= qp.quant_max))
        return (torch.clamp(q, qp.quant_min, qp.quant_max) - zero_point) * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (inside,) = ctx.saved_tensors
        return grad * inside, None


def fake_quantize(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """``dequantize(quantize(x))`` in float32, differentiable with a straight-through gradient.

    Values equal torch's ``fake_quantize_per_{tensor,channel}_affine`` (which it replaces), and the
    gradient is 1 inside the representable range and 0 where the value saturates, as in torch. NaN
    alone differs on purpose: it stays NaN, where torch gives ``quant_min``'s value and so hides a
    training that has diverged behind finite outputs.
    """
    return _FakeQuantizeSTE.apply(x, qp)
