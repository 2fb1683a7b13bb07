"""Ops that run unchanged on quantized tensors (verified on fbgemm and qnnpack, quint8 and qint8).

Lowering removes the dequantize/quantize pair around them and the output keeps the input's
qparams; backends register them as ``KernelSpec(passthrough=True)``. Targets are functions,
``call_method`` names (str) and module classes, as the pattern format uses. Some run only some of
their calls (upsampling: :data:`PASSTHROUGH_CHECKS`); the others keep the reference form.
"""

from __future__ import annotations

import inspect
import operator
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.errors import ConstraintViolationError
from qplug_core.kernels.base import KernelContext
from qplug_core.kernels.capabilities import engine_capabilities

#: zero padding (planning lets constant-zero pads only, ``flows/exact_share.py``): torch pads a
#: quantized tensor with its zero point, the exact int8 image of 0
_PADS = (F.pad, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d, nn.ZeroPad1d, nn.ZeroPad2d,
         nn.ZeroPad3d)

PASSTHROUGH_OPS: tuple[object, ...] = (
    # pooling (max pooling and averaging keep the input's qparams)
    F.max_pool1d, F.max_pool2d, nn.MaxPool1d, nn.MaxPool2d,
    F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    torch.mean, "mean",
    # shape and data movement
    torch.flatten, nn.Flatten, "flatten", "reshape", "view", "permute", "transpose", "contiguous",
    torch.reshape, torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze,
    "squeeze", "unsqueeze", torch.chunk, torch.split, "chunk", "split", torch.narrow, "narrow",
    "repeat", "expand", F.pixel_shuffle, nn.PixelShuffle, operator.getitem,
    F.interpolate, nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d,  # some modes only
    # clipping activations (exact on the integer grid)
    F.relu, torch.relu, nn.ReLU, "relu", F.dropout, nn.Dropout, nn.Identity,
    *_PADS,
)

#: passthrough ops some engines lack or get wrong (they run under the model's pinned engine):
#: a missing flag leaves the op in reference form, which is always right
_ENGINE_DEPENDENT: dict[str, tuple[object, ...]] = {
    "max_pool3d": (F.max_pool3d, nn.MaxPool3d),
    "clamp_channels_last": (F.relu6, nn.ReLU6, F.hardtanh, nn.Hardtanh, torch.clamp, "clamp"),
}


def passthrough_ops(engine: str) -> tuple[object, ...]:
    """:data:`PASSTHROUGH_OPS` plus those ``engine`` gets right by probe (not on qnnpack: max_pool3d,
    and relu6 / hardtanh / clamp, wrong on channels_last tensors in torch 2.13)."""
    return PASSTHROUGH_OPS + _engine_dependent(engine, supported=True)


def unsupported_passthrough_ops(engine: str) -> tuple[object, ...]:
    """The engine-dependent passthrough ops ``engine`` lacks or gets wrong: eager convert, which
    leaves unobserved modules running on quantized tensors, runs these on dequantized values."""
    return _engine_dependent(engine, supported=False)


def _engine_dependent(engine: str, *, supported: bool) -> tuple[object, ...]:
    caps = engine_capabilities(engine)
    return tuple(op for flag, ops in _ENGINE_DEPENDENT.items() if getattr(caps, flag) == supported
                 for op in ops)


#: the upsampling modes torch 2.13's quantized CPU tensors have kernels for, and the input ranks each
#: takes (nearest and nearest-exact in 2-d and 3-d, bilinear without antialias in 2-d, area: adaptive
#: average pooling); the others (bicubic, trilinear, linear, antialiased) and 1-d nearest raise
#: NotImplementedError
_QUANTIZED_UPSAMPLING = {"nearest": (4, 5), "nearest-exact": (4, 5), "bilinear": (4,), "area": (3, 4, 5)}


def check_upsampling(ctx: KernelContext) -> None:
    """Refuse an ``F.interpolate`` / ``nn.Upsample`` whose mode, or whose input's rank on the example
    (``ctx.input_shapes``), has no quantized kernel: lowered, it raised NotImplementedError at every
    call of the converted model."""
    if ctx.module is not None:
        mode, antialias = ctx.module.mode, False  # nn.Upsample has no antialias
    else:
        call = inspect.signature(F.interpolate).bind(*ctx.args, **ctx.kwargs).arguments
        mode, antialias = call.get("mode", "nearest"), call.get("antialias", False)
    ranks = _QUANTIZED_UPSAMPLING.get(mode)
    if ranks is None or antialias:
        how = f"mode {mode!r}" + (" with antialias=True" if antialias else "")
        raise ConstraintViolationError(
            f"upsampling {how} has no int8 kernel in torch (quantized tensors take mode 'nearest', "
            "'nearest-exact', 'area' or 'bilinear' without antialias), so it runs in float between a "
            "dequantize and a quantize")
    shape = tuple(ctx.input_shapes[0]) if ctx.input_shapes else None
    if mode == "bilinear" and shape is not None and len(shape) == 4 and shape[2:] == (1, 1):
        raise ConstraintViolationError(
            "bilinear upsampling of a 1x1 map (a global-pool branch, as in DeepLab's ASPP) is wrong in "
            "torch's int8 kernel (up to 250 steps off on fbgemm, x86 and qnnpack, torch 2.13), so it runs in "
            "float between a dequantize and a quantize")
    rank = len(shape) if shape is not None else None
    if rank is not None and rank not in ranks:
        taken = " and ".join(f"{r - 2}-d" for r in ranks)
        raise ConstraintViolationError(
            f"upsampling mode {mode!r} in {rank - 2}-d (a {rank}-d input) has no int8 kernel in torch "
            f"(quantized tensors take it in {taken} only), so it runs in float between a dequantize and "
            "a quantize")


def check_padding(ctx: KernelContext) -> None:
    """Refuse a pad of a 5-D input: a conv3d's int8 output is channels-last 3-D, and torch 2.13's
    quantized pad copies contiguous and channels-last 4-D tensors only (it raised RuntimeError)."""
    if ctx.input_shapes and len(ctx.input_shapes[0]) >= 5:
        raise ConstraintViolationError(
            "padding a 5-D int8 tensor raises in torch (its quantized copy takes contiguous and "
            "channels-last 4-D tensors only), so it runs in float between a dequantize and a quantize")


#: passthrough ops whose int8 kernels in torch 2.13 (fbgemm, x86, qnnpack) misread a batch-1 tensor
#: torch calls channels-last while its batch stride is not that of a dense one: tokens transposed
#: and reshaped into a map, as SegFormer's decoder feeds ``F.interpolate`` (up to 255 steps off)
_BATCH_STRIDE_FUNCTIONS = (F.interpolate, F.max_pool2d, F.max_pool3d, F.avg_pool2d, F.avg_pool3d,
                           F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)
_BATCH_STRIDE_MODULES = (nn.Upsample, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool2d, nn.AvgPool3d,
                         nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)


def reads_batch_stride(op: object) -> bool:
    """Whether passthrough ``op`` (a function, or a module instance) must get its input through
    :func:`dense_batch_stride`."""
    return op in _BATCH_STRIDE_FUNCTIONS or isinstance(op, _BATCH_STRIDE_MODULES)


def dense_batch_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a batch of one given the batch stride of a dense tensor: the same elements, no copy
    (a size-1 dim's stride addresses nothing), which those kernels read right."""
    if x.dim() >= 4 and x.size(0) == 1 and x.stride(0) != x.numel() and x.numel():
        return x.as_strided(x.size(), (x.numel(), *x.stride()[1:]))
    return x


#: passthrough ops that run only some of their calls -> the check refusing the others (KernelSpec.check)
PASSTHROUGH_CHECKS: dict[object, Callable[[KernelContext], None]] = {
    F.interpolate: check_upsampling, nn.Upsample: check_upsampling,
    nn.UpsamplingNearest2d: check_upsampling, nn.UpsamplingBilinear2d: check_upsampling,
    **{pad: check_padding for pad in _PADS},
}
