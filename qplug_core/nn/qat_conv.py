"""QAT convolutions: Conv, ConvReLU, ConvBn and ConvBnReLU in 1d/2d/3d.

The twelve classes come from one factory, :func:`_conv_family`, parameterised by dimension; each
subclasses its ``nn.Conv{d}d`` so that it is a conv to every other piece of code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.ir.torch_ao_apply import TORCH_AO_CONV_FUSED, AnswersTorchAoApply
from qplug_core.nn import intrinsic as nni
from qplug_core.nn.qat_base import QATModule, QATWithBn, freeze_bn_stats, update_bn_stats

__all__ = [
    "Conv1d", "Conv2d", "Conv3d",
    "ConvBn1d", "ConvBn2d", "ConvBn3d",
    "ConvBnReLU1d", "ConvBnReLU2d", "ConvBnReLU3d",
    "ConvReLU1d", "ConvReLU2d", "ConvReLU3d",
    "conv_forward",
]

_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _pad_amounts(conv: nn.Module) -> list[int]:
    """``F.pad`` amounts (last dim first) equivalent to the conv's padding, for non-zero modes."""
    dims = len(conv.kernel_size)
    if conv.padding == "valid":
        return [0] * (2 * dims)
    if conv.padding == "same":
        totals = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        pairs = [(t // 2, t - t // 2) for t in totals]
    else:
        pairs = [(p, p) for p in conv.padding]
    return [amount for pair in reversed(pairs) for amount in pair]


def conv_forward(conv: nn.Module, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``conv``'s convolution (stride, padding incl. mode, dilation, groups) with the given weights."""
    fn = _CONV_FN[weight.dim() - 2]
    if conv.padding_mode == "zeros":
        return fn(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)
    padded = F.pad(x, _pad_amounts(conv), mode=conv.padding_mode)
    return fn(padded, weight, bias, conv.stride, 0, conv.dilation, conv.groups)


class _QATConv(QATModule):
    """Conv with a fake-quantized weight; ``WITH_RELU`` subclasses apply relu after it."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
                 padding: Any = 0, dilation: Any = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", *, qconfig: Any = None, device: Any = None,
                 dtype: Any = None):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride,  # type: ignore[call-arg]
                         padding=padding, dilation=dilation, groups=groups, bias=bias,
                         padding_mode=padding_mode, device=device, dtype=dtype)
        self._init_fake_quant(qconfig)

    @staticmethod
    def _root_args(root: nn.Module) -> dict[str, Any]:
        return {"in_channels": root.in_channels, "out_channels": root.out_channels,
                "kernel_size": root.kernel_size, "stride": root.stride, "padding": root.padding,
                "dilation": root.dilation, "groups": root.groups, "bias": root.bias is not None,
                "padding_mode": root.padding_mode}

    def _apply_weight(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return conv_forward(self, x, weight, bias)


class _QATConvBn(AnswersTorchAoApply, QATWithBn, _QATConv):
    """Conv + BatchNorm trained together (see :class:`QATWithBn` for the algorithm).

    ``model.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)`` (or ``update_bn_stats``) runs qplug's
    namesake here, as torch.ao's does on its ConvBn classes (and, like it, not on LinearBn1d).
    """

    TORCH_AO_TWINS = {f"{TORCH_AO_CONV_FUSED}.{fn.__name__}": fn for fn in (freeze_bn_stats, update_bn_stats)}

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
                 padding: Any = 0, dilation: Any = 1, groups: int = 1, bias: bool = False,
                 padding_mode: str = "zeros", eps: float = 1e-5, momentum: float | None = 0.1,
                 freeze_bn: bool = False, *, qconfig: Any = None, device: Any = None,
                 dtype: Any = None):
        _QATConv.__init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation,
                          groups, bias, padding_mode, qconfig=qconfig, device=device, dtype=dtype)
        self._init_bn(out_channels, eps, momentum, freeze_bn, device, dtype)


def _conv_family(dim: int) -> tuple[type[nn.Module], ...]:
    """Conv, ConvReLU, ConvBn, ConvBnReLU QAT classes for one dimension."""
    float_conv = nni.CONV_BY_DIM[dim]
    fused = {name: getattr(nni, f"{name}{dim}d") for name in ("ConvReLU", "ConvBn", "ConvBnReLU")}

    def make(name: str, bases: tuple[type, ...], float_module: type, relu: bool,
             doc: str, **extra: Any) -> type[nn.Module]:
        attrs = {"__module__": __name__, "__qualname__": name, "__doc__": doc,
                 "FLOAT_MODULE": float_module, "FLOAT_ROOT": float_conv,
                 "FUSED_FLOAT": fused["ConvReLU"], "WITH_RELU": relu, **extra}
        return type(name, bases, attrs)

    conv = make(f"Conv{dim}d", (_QATConv, float_conv), float_conv, False,
                f"QAT Conv{dim}d: convolution with a fake-quantized weight.")
    conv_relu = make(f"ConvReLU{dim}d", (conv,), fused["ConvReLU"], True,
                     f"QAT ConvReLU{dim}d: relu(conv) with a fake-quantized weight.")
    conv_bn = make(f"ConvBn{dim}d", (_QATConvBn, float_conv), fused["ConvBn"], False,
                   f"QAT ConvBn{dim}d: conv + BatchNorm{dim}d trained with BN statistics.",
                   BN_CLASS=nni.BN_BY_DIM[dim])
    conv_bn_relu = make(f"ConvBnReLU{dim}d", (conv_bn,), fused["ConvBnReLU"], True,
                        f"QAT ConvBnReLU{dim}d: relu(bn(conv)) trained with BN statistics.")
    return conv, conv_relu, conv_bn, conv_bn_relu


Conv1d, ConvReLU1d, ConvBn1d, ConvBnReLU1d = _conv_family(1)
Conv2d, ConvReLU2d, ConvBn2d, ConvBnReLU2d = _conv_family(2)
Conv3d, ConvReLU3d, ConvBn3d, ConvBnReLU3d = _conv_family(3)
