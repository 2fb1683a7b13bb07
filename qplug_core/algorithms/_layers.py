"""What the algorithms need to know about weighted layers in a fused float graph.

Fusion leaves a weighted op either as the bare module (``Conv2d`` with batch norm folded in,
``Linear``) or as a fused container whose ``[0]`` is that module and whose other children are
scale-equivariant activations (``ConvReLU2d``, ``LinearReLU``). The algorithms rescale the
weighted module's channels, so they look through the container to it.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from qplug_core.nn.intrinsic import FusedModule

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
WEIGHTED = (*CONVS, nn.Linear)
#: activations for which ``f(x / s) == f(x) / s`` for every ``s > 0``
POSITIVE_HOMOGENEOUS = (nn.ReLU, nn.Identity, nn.Dropout)


def weighted_layer(module: nn.Module) -> nn.Module | None:
    """The Conv/Linear a node's module computes with, if every other part is positive-homogeneous."""
    if type(module) in WEIGHTED:
        return module
    if isinstance(module, FusedModule) and len(module) and type(module[0]) in WEIGHTED and all(
            isinstance(child, POSITIVE_HOMOGENEOUS) for child in list(module)[1:]):
        return module[0]
    return None


def layer_of(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The weighted layer ``node`` calls, or None."""
    if node.op != "call_module":
        return None
    return weighted_layer(gm.get_submodule(node.target))


def output_channels(layer: nn.Module) -> int:
    return layer.out_channels if isinstance(layer, CONVS) else layer.out_features


def input_channels(layer: nn.Module) -> int:
    return layer.in_channels if isinstance(layer, CONVS) else layer.in_features


def output_channel_range(layer: nn.Module) -> torch.Tensor:
    """max |w| over each output channel's weights."""
    return layer.weight.detach().abs().flatten(1).amax(1)


def input_channel_range(layer: nn.Module) -> torch.Tensor:
    """max |w| over every weight that reads input channel ``c``, for each ``c`` (groups handled)."""
    weight = layer.weight.detach().abs()
    groups = getattr(layer, "groups", 1)
    per_group_in = weight.shape[1]
    out_per_group = weight.shape[0] // groups
    # [groups, out_per_group, in_per_group, ...] -> max over outputs and kernel -> [groups, in_pg]
    grouped = weight.reshape(groups, out_per_group, per_group_in, -1)
    return grouped.amax(dim=(1, 3)).reshape(groups * per_group_in)


@torch.no_grad()
def scale_output_channels(layer: nn.Module, factor: torch.Tensor) -> None:
    """Multiply output channel ``i`` (weight row and bias) by ``factor[i]``."""
    shape = (-1,) + (1,) * (layer.weight.dim() - 1)
    layer.weight.mul_(factor.view(shape))
    if layer.bias is not None:
        layer.bias.mul_(factor)


@torch.no_grad()
def scale_input_channels(layer: nn.Module, factor: torch.Tensor) -> None:
    """Multiply every weight reading input channel ``c`` by ``factor[c]`` (groups handled)."""
    weight = layer.weight
    groups = getattr(layer, "groups", 1)
    per_group_in, out_per_group = weight.shape[1], weight.shape[0] // groups
    view = weight.view(groups, out_per_group, per_group_in, -1)
    view.mul_(factor.view(groups, 1, per_group_in, 1))
