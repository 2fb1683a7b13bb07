"""A conv's output times a per-channel constant plus another, as the eval-mode BatchNorm it is.

Frozen BatchNorms (DETR's, ConditionalDETR's and MaskFormer's ``FrozenBatchNorm2d``, torchvision's)
compute ``x * scale + shift`` with buffers; export folds those to two constants, and the graph
keeps an int8 ``mul`` and ``add`` after every conv: two broadcasting kernels, each slower than the
conv itself (DETR ran slower than float), and two more roundings. Written as
``aten.batch_norm(x, scale, shift, mean=0, var=1, eps=0)`` the pair is the BatchNorm the raise pass
makes a module of and fusion folds into the conv, as it does a real one.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import fx

from qplug_core.ir.attributes import fetch_attribute

__all__ = ["channel_affines_as_batch_norm"]

aten = torch.ops.aten


def channel_affines_as_batch_norm(gm: fx.GraphModule, after: Collection[Any]) -> None:
    """Rewrite ``add(mul(y, scale), shift)`` into ``aten.batch_norm`` where ``y`` is the output of
    one of the ops in ``after`` read by that ``mul`` alone and both constants hold one value per
    channel (dim 1) of ``y``, of ``y``'s dtype."""
    for mul in list(gm.graph.nodes):
        if mul.op != "call_function" or mul.target is not aten.mul.Tensor or mul.kwargs:
            continue
        y, scale = _tensor_and_constant(gm, mul.args)
        if (y is None or y.op != "call_function" or y.target not in after or len(y.users) != 1
                or len(mul.users) != 1):
            continue
        add = next(iter(mul.users))
        if add.op != "call_function" or add.target is not aten.add.Tensor or add.kwargs:
            continue
        _, shift = _tensor_and_constant(gm, add.args, tensor=mul)
        channels = _channels(y)
        scale, shift = _per_channel(scale, y, channels), _per_channel(shift, y, channels)
        if scale is None or shift is None:
            continue
        _replace(gm, mul, add, y, (scale, shift, torch.zeros_like(scale), torch.ones_like(scale)))


def _tensor_and_constant(gm: fx.GraphModule, args: tuple, tensor: fx.Node | None = None
                         ) -> tuple[fx.Node | None, torch.Tensor | None]:
    """(the computed operand, the value of the ``get_attr`` one) of a binary op, either order."""
    if len(args) != 2 or not all(isinstance(a, fx.Node) for a in args):
        return None, None
    for x, c in (args, args[::-1]):
        if c.op == "get_attr" and x.op != "get_attr" and (tensor is None or x is tensor):
            value = fetch_attribute(gm, str(c.target))
            return (x, value) if isinstance(value, torch.Tensor) else (None, None)
    return None, None


def _channels(y: fx.Node) -> int | None:
    value = y.meta.get("val")
    return value.shape[1] if isinstance(value, torch.Tensor) and 3 <= value.dim() <= 5 else None


def _per_channel(constant: torch.Tensor | None, y: fx.Node, channels: int | None) -> torch.Tensor | None:
    """``constant`` as ``channels`` values, when it broadcasts against ``y`` along dim 1 only."""
    if constant is None or channels is None:
        return None
    value = y.meta["val"]
    shape = (1,) * (value.dim() - constant.dim()) + tuple(constant.shape)
    if (constant.dtype != value.dtype or constant.dim() > value.dim() or shape[1] not in (1, channels)
            or any(size != 1 for i, size in enumerate(shape) if i != 1)):
        return None
    return constant.detach().reshape(-1).expand(channels).clone()


def _replace(gm: fx.GraphModule, mul: fx.Node, add: fx.Node, y: fx.Node,
             buffers: tuple[torch.Tensor, ...]) -> None:
    graph = gm.graph
    names = []
    for role, value in zip(("weight", "bias", "mean", "var"), buffers):
        name, i = f"_channel_affine_{role}", 1
        while hasattr(gm, name):
            name, i = f"_channel_affine_{role}_{i}", i + 1
        gm.register_buffer(name, value)
        names.append(name)
    with graph.inserting_before(add):
        attrs = [graph.get_attr(name) for name in names]
        bn = graph.call_function(aten.batch_norm.default, (y, *attrs, False, 0.1, 0.0, False))
    bn.meta = dict(add.meta)
    add.replace_all_uses_with(bn)
    constants = dict.fromkeys(a for a in (*mul.args, *add.args) if isinstance(a, fx.Node) and a.op == "get_attr")
    graph.erase_node(add)
    graph.erase_node(mul)
    for constant in constants:
        if not constant.users:
            graph.erase_node(constant)
