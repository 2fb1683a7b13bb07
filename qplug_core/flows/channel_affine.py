"""A conv's output times a per-channel constant plus another, folded into the conv.

Frozen BatchNorms (DETR's, ConditionalDETR's and MaskFormer's ``FrozenBatchNorm2d``, torchvision's)
compute ``x * scale + shift`` with buffers; export folds those to two constants, and the graph
kept an int8 ``mul`` and ``add`` after every conv: two broadcasting kernels, each slower than the
conv itself (DETR ran slower than float), and two more roundings. The pair is a constant affine
map per output channel, so it folds into the conv's weight and bias as an eval-mode BatchNorm does
(:mod:`qplug_core.nn.folding`), in training graphs too: nothing in it is learned or updated.
Each fold is recorded (:data:`FOLDED_AFFINES`): the conv's output is now the value after the affine,
so ``qp.compare`` pairs it with that float value, not the float conv's own.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx, nn

from qplug_core.flows.tags import FOLDED_AFFINES
from qplug_core.ir import module_stack
from qplug_core.ir.attributes import fetch_attribute

__all__ = ["FoldedAffine", "fold_channel_affines"]


@dataclass(frozen=True)
class FoldedAffine:
    """``x * scale + shift`` per output channel, folded into a conv's weights."""

    scale: torch.Tensor
    shift: torch.Tensor
    #: the float module that computed it (a ``FrozenBatchNorm2d``), ``""`` when not a module of its own
    module: str
    op: str = "affine"

    def apply(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as the float model has it after the affine (channels on dim 1)."""
        shape = (-1, *(1,) * (value.dim() - 2))
        return value * self.scale.reshape(shape).to(value.dtype) + self.shift.reshape(shape).to(value.dtype)

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def fold_channel_affines(gm: fx.GraphModule) -> None:
    """Fold ``add(mul(conv(x), scale), shift)`` into the conv where the conv module is called once,
    its output is read by that ``mul`` alone and both constants hold one value per output channel
    (dim 1) of the conv's output, of its dtype. The conv gets new parameters (the user's stay)."""
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    for mul in list(gm.graph.nodes):
        if mul.op != "call_function" or mul.target is not operator.mul or mul.kwargs:
            continue
        y, scale = _tensor_and_constant(gm, mul.args)
        if (y is None or y.op != "call_module" or calls.get(str(y.target)) != 1 or len(y.users) != 1
                or len(mul.users) != 1 or not isinstance(conv := gm.get_submodule(str(y.target)), _CONVS)):
            continue
        add = next(iter(mul.users))
        if add.op != "call_function" or add.target is not operator.add or add.kwargs:
            continue
        _, shift = _tensor_and_constant(gm, add.args, tensor=mul)
        channels = _channels(y)
        scale, shift = _per_channel(scale, y, channels), _per_channel(shift, y, channels)
        if scale is None or shift is None:
            continue
        _fold(conv, scale, shift)
        path, _ = module_stack.innermost(mul)
        gm.meta.setdefault(FOLDED_AFFINES, {})[str(y.target)] = FoldedAffine(
            scale, shift, path if path != module_stack.innermost(y)[0] else "")
        _erase(gm, mul, add, y)


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


def _fold(conv: nn.Module, scale: torch.Tensor, shift: torch.Tensor) -> None:
    weight = conv.weight.detach() * scale.reshape(-1, *(1,) * (conv.weight.dim() - 1))
    bias = shift if conv.bias is None else conv.bias.detach() * scale + shift
    conv.weight = nn.Parameter(weight, requires_grad=conv.weight.requires_grad)
    conv.bias = nn.Parameter(bias, requires_grad=conv.weight.requires_grad)


def _erase(gm: fx.GraphModule, mul: fx.Node, add: fx.Node, y: fx.Node) -> None:
    graph = gm.graph
    add.replace_all_uses_with(y)
    constants = dict.fromkeys(a for a in (*mul.args, *add.args) if isinstance(a, fx.Node) and a.op == "get_attr")
    graph.erase_node(add)
    graph.erase_node(mul)
    for constant in constants:
        if not constant.users:
            graph.erase_node(constant)
