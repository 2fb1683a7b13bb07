"""Normalization kernels: batch_norm{2,3}d(+relu), layer_norm, group_norm, instance_norm.

The quantized ops take float affine parameters and running statistics; they are copied (detached)
from the float module at build time so later edits of the float model do not leak in.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from qplug_core.kernels._common import (
    SELF_TEST_INPUT,
    KernelModule,
    forward_quiet,
    output_qparams,
    split_fused_relu,
)
from qplug_core.kernels.base import KernelContext, PackedStateModule, TensorArg

_Q = torch.ops.quantized


def _affine(mod: nn.Module, size: int | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) as float tensors; identity when the module has no affine parameters."""
    weight = torch.ones(size) if mod.weight is None else mod.weight.detach().float().clone()
    bias = torch.zeros(size) if mod.bias is None else mod.bias.detach().float().clone()
    return weight, bias


class _Norm(KernelModule, PackedStateModule):
    """A norm op bound to its float parameters; ``forward(x)`` requantizes to the output qparams."""

    _float_type: type[nn.Module] | tuple[type[nn.Module], ...]

    def __init__(self, op: Callable[..., torch.Tensor], params: tuple, scale: float, zero_point: int):
        super().__init__()
        self._op, self._params = op, params
        self.scale, self.zero_point = scale, zero_point

    @classmethod
    def _bind(cls, mod: nn.Module, relu: bool) -> tuple[Callable[..., torch.Tensor], tuple]:
        """(op, args between the input and the output qparams)."""
        raise NotImplementedError

    @classmethod
    def from_context(cls, ctx: KernelContext) -> _Norm:
        mod, relu = split_fused_relu(ctx.module, cls._float_type, cls.__name__)
        scale, zp, _ = output_qparams(ctx)
        op, params = cls._bind(mod, relu)
        return cls(op, params, scale, zp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with forward_quiet():
            return self._op(x, *self._params, self.scale, self.zero_point)

    @classmethod
    def _self_test_module(cls) -> tuple[nn.Module, tuple[int, ...]]:
        raise NotImplementedError

    @classmethod
    def _self_test_case(cls, engine: str):
        mod, shape = cls._self_test_module()
        with torch.no_grad():
            for p in (mod.weight, mod.bias):
                p.uniform_(-1.0, 1.0, generator=torch.Generator().manual_seed(2))
        mod.eval()
        ctx = KernelContext(pattern=cls.__name__, module=mod, target=type(mod), args=(TensorArg(0),),
                            input_qparams=(SELF_TEST_INPUT,))
        return ctx, mod, (shape,)


class _BatchNormNd(_Norm):
    _dim: int

    @classmethod
    def _bind(cls, mod: nn.Module, relu: bool) -> tuple[Callable[..., torch.Tensor], tuple]:
        name = f"batch_norm{cls._dim}d_relu" if relu else f"batch_norm{cls._dim}d"
        weight, bias = _affine(mod, mod.num_features)
        return getattr(_Q, name), (weight, bias, mod.running_mean.detach().clone(),
                                   mod.running_var.detach().clone(), float(mod.eps))

    @classmethod
    def _self_test_module(cls) -> tuple[nn.Module, tuple[int, ...]]:
        bn = getattr(nn, f"BatchNorm{cls._dim}d")(3)
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 1.5)
        return bn, (2, 3) + (4,) * cls._dim


class BatchNorm2d(_BatchNormNd):
    """``nn.BatchNorm2d`` (+ReLU) -> quantized.batch_norm2d / batch_norm2d_relu."""

    _float_type, _dim = nn.BatchNorm2d, 2


class BatchNorm3d(_BatchNormNd):
    """``nn.BatchNorm3d`` (+ReLU) -> quantized.batch_norm3d / batch_norm3d_relu."""

    _float_type, _dim = nn.BatchNorm3d, 3


class LayerNorm(_Norm):
    """``nn.LayerNorm`` -> quantized.layer_norm."""

    _float_type = nn.LayerNorm

    @classmethod
    def _bind(cls, mod: nn.Module, relu: bool) -> tuple[Callable[..., torch.Tensor], tuple]:
        shape = tuple(mod.normalized_shape)
        weight, bias = _affine(mod, shape)
        return _Q.layer_norm, (list(shape), weight, bias, float(mod.eps))

    @classmethod
    def _self_test_module(cls) -> tuple[nn.Module, tuple[int, ...]]:
        return nn.LayerNorm(8), (2, 3, 8)


class GroupNorm(_Norm):
    """``nn.GroupNorm`` -> quantized.group_norm."""

    _float_type = nn.GroupNorm

    @classmethod
    def _bind(cls, mod: nn.Module, relu: bool) -> tuple[Callable[..., torch.Tensor], tuple]:
        weight, bias = _affine(mod, mod.num_channels)
        return _Q.group_norm, (mod.num_groups, weight, bias, float(mod.eps))

    @classmethod
    def _self_test_module(cls) -> tuple[nn.Module, tuple[int, ...]]:
        return nn.GroupNorm(2, 4), (2, 4, 5, 5)


class InstanceNorm(_Norm):
    """``nn.InstanceNorm{1,2,3}d`` -> quantized.instance_norm (uses instance statistics only)."""

    _float_type = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)

    @classmethod
    def _bind(cls, mod: nn.Module, relu: bool) -> tuple[Callable[..., torch.Tensor], tuple]:
        weight, bias = _affine(mod, mod.num_features)
        return _Q.instance_norm, (weight, bias, float(mod.eps))

    @classmethod
    def _self_test_module(cls) -> tuple[nn.Module, tuple[int, ...]]:
        return nn.InstanceNorm2d(3, affine=True), (2, 3, 5, 5)
