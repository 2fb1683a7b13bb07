"""Folding an eval-mode BatchNorm into the weighted op before it.

In eval mode ``bn(y) = gamma * (y - mean) / sqrt(var + eps) + beta`` is a per-channel affine map,
so it can be absorbed into the preceding conv / conv-transpose / linear:

    s  = gamma / sqrt(var + eps)            (one factor per output channel)
    W' = W * s   (along the output-channel axis of W)
    b' = (b - mean) * s + beta

One int8 kernel then computes both ops, with one rounding instead of two.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from qplug_core.errors import ConfigValidationError
from qplug_core.nn.copying import copy_module

__all__ = ["bn_scale", "fold_bn_into_conv", "fold_bn_into_linear", "fold_bn_weights"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def bn_scale(running_var: torch.Tensor, eps: float, gamma: torch.Tensor | None) -> torch.Tensor:
    """The per-channel factor ``gamma / sqrt(running_var + eps)`` (gamma = 1 without affine)."""
    inv_std = torch.rsqrt(running_var + eps)
    return inv_std if gamma is None else gamma * inv_std


def fold_bn_weights(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    eps: float,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    *,
    transposed: bool = False,
    groups: int = 1,
    linear: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(W', b')`` with the BN folded in; the inputs are not modified.

    The bias is rounded as torch's ``fuse_conv_bn_weights`` (``(b - mean) * inv_std * gamma``)
    or, with ``linear=True``, ``fuse_linear_bn_weights`` (``(b - mean) * s``) round it, so models
    folded here equal torch.ao's bit for bit (one ulp moved a histogram observer's scale).

    ``weight`` is ``(out, in/groups, *k)`` for conv and linear, ``(in, out/groups, *k)`` for conv
    transpose (``transposed=True``), where output channel ``g * out/groups + j`` lives at
    ``weight[g * in/groups : (g+1) * in/groups, j]``. A BN with a single feature broadcasts over all
    output channels (as ``torch.nn.utils.fuse_linear_bn_eval`` allows).
    """
    scale = bn_scale(running_var, eps, gamma)
    out_channels = weight.shape[1] * groups if transposed else weight.shape[0]
    scale = scale.expand(out_channels) if scale.numel() == 1 else scale
    mean = running_mean.expand(out_channels) if running_mean.numel() == 1 else running_mean
    if transposed:
        per_group_in = weight.shape[0] // groups
        grouped = weight.reshape(groups, per_group_in, weight.shape[1], *weight.shape[2:])
        factor = scale.reshape(groups, 1, weight.shape[1], *([1] * (weight.dim() - 2)))
        new_weight = (grouped * factor).reshape(weight.shape)
    else:
        new_weight = weight * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    old_bias = torch.zeros_like(mean) if bias is None else bias
    if linear or gamma is None:
        new_bias = (old_bias - mean) * scale
    else:
        inv_std = torch.rsqrt(running_var + eps)
        new_bias = (old_bias - mean) * inv_std.expand_as(mean) * gamma.expand_as(mean)
    if beta is not None:
        new_bias = new_bias + beta
    bias_dtype = weight.dtype if bias is None else bias.dtype
    return new_weight.to(weight.dtype), new_bias.to(bias_dtype)


def _check_foldable(op: nn.Module, bn: nn.Module, out_channels: int) -> None:
    if not isinstance(bn, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        raise ConfigValidationError(f"Can only fold a BatchNorm, got {type(bn).__name__}",
                                    field="bn", value=type(bn))
    if op.training or bn.training:
        raise ConfigValidationError(
            f"Folding {type(bn).__name__} into {type(op).__name__} needs eval-mode modules (it uses "
            "the running statistics); call model.eval() before fusing, or fuse for QAT to keep BatchNorm "
            "trainable (qp.eager.fuse_modules_qat in eager mode, qp.prepare_qat_fx in graph mode)",
            field="training", value=True)
    if bn.running_mean is None or bn.running_var is None:
        raise ConfigValidationError(
            f"Cannot fold {type(bn).__name__} built with track_running_stats=False: "
            "it has no running statistics", field="track_running_stats", value=False)
    if bn.num_features not in (out_channels, 1):
        raise ConfigValidationError(
            f"{type(bn).__name__} has {bn.num_features} features but {type(op).__name__} has "
            f"{out_channels} output channels", field="num_features", value=bn.num_features)


def _fold(op: ModuleT, bn: nn.Module, *, transposed: bool, groups: int) -> ModuleT:
    weight, bias = fold_bn_weights(
        op.weight.detach(), None if op.bias is None else op.bias.detach(),
        bn.running_mean, bn.running_var, bn.eps,
        None if bn.weight is None else bn.weight.detach(),
        None if bn.bias is None else bn.bias.detach(),
        transposed=transposed, groups=groups, linear=isinstance(op, nn.Linear))
    folded_weight = nn.Parameter(weight, requires_grad=op.weight.requires_grad)
    folded_bias = nn.Parameter(bias, requires_grad=op.weight.requires_grad if op.bias is None
                               else op.bias.requires_grad)
    # the copy takes the folded tensors in place of op's (a memo entry): cloning op's weight and
    # bias only to replace them cost one clone per fused conv
    memo: dict[int, object] = {id(op.weight): folded_weight}
    if op.bias is not None:
        memo[id(op.bias)] = folded_bias
    fused = copy_module(op, memo)
    fused.weight, fused.bias = folded_weight, folded_bias  # a bias-free op gets one
    return fused


def fold_bn_into_conv(conv: ModuleT, bn: nn.Module) -> ModuleT:
    """A new conv (or conv transpose) computing ``bn(conv(x))`` in eval mode; inputs unchanged."""
    if not isinstance(conv, (nn.Conv1d, nn.Conv2d, nn.Conv3d,
                             nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        raise ConfigValidationError(f"fold_bn_into_conv needs a Conv or ConvTranspose module, "
                                    f"got {type(conv).__name__}", field="conv", value=type(conv))
    _check_foldable(conv, bn, conv.out_channels)
    return _fold(conv, bn, transposed=conv.transposed, groups=conv.groups)


def fold_bn_into_linear(linear: ModuleT, bn: nn.Module) -> ModuleT:
    """A new Linear computing ``bn(linear(x))`` in eval mode; inputs unchanged."""
    if not isinstance(linear, nn.Linear):
        raise ConfigValidationError(f"fold_bn_into_linear needs an nn.Linear, got "
                                    f"{type(linear).__name__}", field="linear", value=type(linear))
    _check_foldable(linear, bn, linear.out_features)
    return _fold(linear, bn, transposed=False, groups=1)
