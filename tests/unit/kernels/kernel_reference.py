"""Independent float references for the kernel tests: dequantize, float op, requantize.

Written from the quantization formulas only (no qplug code), so a kernel bug cannot hide in a
shared helper. Requantization rounds half to even (``torch.round``) and clamps.
"""

from __future__ import annotations

import torch

from qplug_core.kernels.base import quiet_quantized_dtypes
from qplug_core.qparams import QParams

ENGINES = ("fbgemm", "qnnpack")


def qrange(dtype: torch.dtype) -> tuple[int, int]:
    return (0, 255) if dtype == torch.quint8 else (-128, 127)


def requantize(x: torch.Tensor, scale: float, zp: int, dtype: torch.dtype = torch.quint8) -> torch.Tensor:
    lo, hi = qrange(dtype)
    return (torch.round(x.double() / scale) + zp).clamp(lo, hi)


def qparams(scale: float, zp: int, dtype: torch.dtype = torch.quint8, axis: int | None = None,
            scales: torch.Tensor | None = None) -> QParams:
    lo, hi = qrange(dtype)
    if scales is not None:
        return QParams(scales.float(), torch.zeros(scales.numel(), dtype=torch.int64), dtype, lo, hi,
                       axis=axis)
    return QParams(torch.tensor(scale), torch.tensor(zp), dtype, lo, hi)


def fake_quant_weight(w: torch.Tensor, qp: QParams) -> torch.Tensor:
    """Weight as the kernel sees it: round-half-even onto the qint8 grid, clamped, dequantized.

    Scaling is torch's ``quantize_per_tensor``: multiply by the float32 reciprocal of the scale,
    so a weight on a rounding tie gets the integer torch (and every qplug flow) gives it.
    """
    s, zp = qp.scale.float(), qp.zero_point.double()
    if qp.axis is not None:
        shape = [1] * w.dim()
        shape[qp.axis] = -1
        s, zp = s.reshape(shape), zp.reshape(shape)
    q = (torch.round((w.float() * (1.0 / s)).double()) + zp).clamp(qp.quant_min, qp.quant_max)
    return ((q - zp) * s.double()).float()


def random_activation(shape: tuple[int, ...], scale: float, zp: int, gen: torch.Generator,
                      high: int = 127, dtype: torch.dtype = torch.quint8) -> torch.Tensor:
    """A quantized activation whose integer values lie in [lo, high].

    For fbgemm the values stay in [0, 127] (reduce_range): on x86 without VNNI, vpmaddubsw adds
    pairs of u8*s8 products into int16 and saturates once 2*255*128 > 32767; 7-bit activations keep
    every pair sum <= 2*127*128 = 32512, so the kernel is exact.
    """
    lo = qrange(dtype)[0]
    ints = torch.randint(lo, high + 1, shape, generator=gen).double()
    with quiet_quantized_dtypes():
        return torch.quantize_per_tensor(((ints - zp) * scale).float(), scale, zp, dtype)


def lsb_diff(out: torch.Tensor, expected_float: torch.Tensor) -> torch.Tensor:
    ref = requantize(expected_float, out.q_scale(), out.q_zero_point(), out.dtype)
    return (out.int_repr().double() - ref).abs()


def output_qparams_covering(y: torch.Tensor, dtype: torch.dtype = torch.quint8) -> QParams:
    lo, hi = min(y.min().item(), 0.0), max(y.max().item(), 0.0)
    scale = max((hi - lo) / 255.0, 1e-3)
    qlo, qhi = qrange(dtype)
    return qparams(scale, int(min(max(qlo - round(lo / scale), qlo), qhi)), dtype)
