"""What a quantized engine can do on *this* torch build, found by probing it.

Support differs by torch version and build flags (per-channel transposed conv, fp16 packing, how
bias is applied), so backends ask here instead of hard-coding tables that go stale (reliability
row 31). Each probe is a tiny pack+run under the engine, checked against a float reference; results are
cached per process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from qplug_core.kernels.base import engine_context

_Q = torch.ops.quantized


@dataclass(frozen=True)
class EngineCapabilities:
    """Probed features of one ``torch.backends.quantized`` engine (all False if unavailable)."""

    engine: str
    available: bool = False
    #: quantized.linear with per-channel (axis 0) qint8 weights
    per_channel_linear: bool = False
    #: quantized.conv{1,2,3}d with per-channel (axis 0) weights
    per_channel_conv: bool = False
    #: quantized.conv_transpose*d with per-channel weights on axis 1 (output channels)
    per_channel_conv_transpose: bool = False
    #: linear/conv accept qint8 (signed) activations; otherwise quint8 only
    qint8_activations: bool = False
    #: each conv kind below runs AND matches a float reference (qnnpack's conv_transpose3d on
    #: torch 2.13 runs but returns wrong numbers)
    conv1d: bool = False
    conv3d: bool = False
    conv_transpose1d: bool = False
    conv_transpose2d: bool = False
    conv_transpose3d: bool = False
    #: linear_prepack_fp16 / linear_dynamic_fp16 (fp16 weight-only dynamic linear)
    fp16_dynamic_linear: bool = False
    #: the engine adds the float bias after requantization instead of quantizing it to int32 with
    #: scale s_in*s_w (where tiny scales overflow it: reliability row 32)
    float_bias: bool = False
    #: max_pool3d on quantized tensors (runs under the *global* engine)
    max_pool3d: bool = False
    #: relu6 / hardtanh / clamp on channels_last quint8 tensors give the float result (torch
    #: 2.13's qnnpack ones do not: MobileNetV2 at -2 dB)
    clamp_channels_last: bool = False


def _qu8(shape: tuple[int, ...], scale: float = 0.05) -> torch.Tensor:
    ints = torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(0))
    return torch.quantize_per_tensor(ints * scale, scale, 0, torch.quint8)


def _qw(shape: tuple[int, ...], per_channel_axis: int | None = None) -> torch.Tensor:
    w = torch.randint(-10, 11, shape, generator=torch.Generator().manual_seed(1)) * 0.01
    if per_channel_axis is None:
        return torch.quantize_per_tensor(w, 0.01, 0, torch.qint8)
    n = shape[per_channel_axis]
    return torch.quantize_per_channel(w, torch.full((n,), 0.01, dtype=torch.double),
                                      torch.zeros(n, dtype=torch.long), per_channel_axis, torch.qint8)


def _matches(y: torch.Tensor, reference: torch.Tensor) -> bool:
    """Running is not enough: a kernel must also be right (within ~1 output LSB)."""
    return bool((y.dequantize() - reference).abs().max() <= 1.01 * y.q_scale())


_OUT_SCALE, _OUT_ZP = 0.05, 128


def _linear(per_channel: bool = False, act: torch.dtype = torch.quint8) -> bool:
    x = torch.quantize_per_tensor(torch.randn(2, 8), 0.05, 0, act)
    w = _qw((4, 8), 0 if per_channel else None)
    y = _Q.linear(x, _Q.linear_prepack(w, None), _OUT_SCALE, _OUT_ZP)
    return _matches(y, F.linear(x.dequantize(), w.dequantize()))


def _conv(dim: int, per_channel: bool = False) -> bool:
    prepack, run = getattr(_Q, f"conv{dim}d_prepack"), getattr(_Q, f"conv{dim}d")
    w, x = _qw((4, 2) + (3,) * dim, 0 if per_channel else None), _qu8((1, 2) + (4,) * dim)
    y = run(x, prepack(w, None, [1] * dim, [1] * dim, [1] * dim, 1), _OUT_SCALE, _OUT_ZP)
    reference = getattr(F, f"conv{dim}d")(x.dequantize(), w.dequantize(), None, 1, 1)
    return _matches(y, reference)


def _conv_transpose(dim: int, per_channel: bool = False) -> bool:
    prepack = getattr(_Q, f"conv_transpose{dim}d_prepack")
    w, x = _qw((2, 4) + (3,) * dim, 1 if per_channel else None), _qu8((1, 2) + (4,) * dim)
    packed = prepack(w, None, [2] * dim, [1] * dim, [0] * dim, [1] * dim, 1)
    y = getattr(_Q, f"conv_transpose{dim}d")(x, packed, _OUT_SCALE, _OUT_ZP)
    reference = getattr(F, f"conv_transpose{dim}d")(x.dequantize(), w.dequantize(), None, 2, 1)
    return _matches(y, reference)


def _fp16_linear() -> None:
    _Q.linear_dynamic_fp16(torch.randn(2, 8), _Q.linear_prepack_fp16(torch.randn(4, 8), None))


def _float_bias() -> bool:
    # |b / (s_in * s_w)| = 5 / (0.05 * 1e-11) = 1e13 >> 2^31: only a float bias survives it
    w = torch.quantize_per_tensor(torch.full((1, 4), 1e-9), 1e-11, 0, torch.qint8)
    y = _Q.linear(_qu8((1, 4)), _Q.linear_prepack(w, torch.tensor([5.0])), 0.05, 0)
    return abs(y.dequantize().item() - 5.0) < 0.1


def _max_pool3d() -> None:
    F.max_pool3d(_qu8((1, 1, 2, 2, 2)), 2)


def _clamp_channels_last() -> bool:
    x = _qu8((1, 8, 3, 3), scale=0.1).contiguous(memory_format=torch.channels_last)
    reference = x.dequantize()
    ops = ((F.relu6, lambda t: t.clamp(0, 6)),
           (lambda t: F.hardtanh(t, -1.0, 2.0), lambda t: t.clamp(-1, 2)),
           (lambda t: torch.clamp(t, 0.5, 3.0), lambda t: t.clamp(0.5, 3.0)))
    return all(_matches(op(x), expected(reference)) for op, expected in ops)


def _works(probe: Callable[[], object]) -> bool:
    try:
        result = probe()
    except (RuntimeError, NotImplementedError):
        return False
    return result is not False


@functools.lru_cache(maxsize=None)
def engine_capabilities(engine: str) -> EngineCapabilities:
    """Probe ``engine`` once (a few ms) and return what it supports on this torch build."""
    if engine not in torch.backends.quantized.supported_engines or engine == "none":
        return EngineCapabilities(engine=engine)
    with engine_context(engine):
        return EngineCapabilities(
            engine=engine,
            available=_works(_linear),
            per_channel_linear=_works(lambda: _linear(per_channel=True)),
            per_channel_conv=_works(lambda: _conv(2, per_channel=True)),
            per_channel_conv_transpose=_works(lambda: _conv_transpose(2, per_channel=True)),
            qint8_activations=_works(lambda: _linear(act=torch.qint8)),
            conv1d=_works(lambda: _conv(1)),
            conv3d=_works(lambda: _conv(3)),
            conv_transpose1d=_works(lambda: _conv_transpose(1)),
            conv_transpose2d=_works(lambda: _conv_transpose(2)),
            conv_transpose3d=_works(lambda: _conv_transpose(3)),
            fp16_dynamic_linear=_works(_fp16_linear),
            float_bias=_works(_float_bias),
            max_pool3d=_works(_max_pool3d),
            clamp_channels_last=_works(_clamp_channels_last),
        )
