"""Which pads and item reads keep their input's qparams exactly (share-qparams regions).

Zero padding writes 0, whose int8 image is the zero point (torch pads a quantized tensor with it),
and a basic slice reads a view of the int8 values: both can share their input's observer. A pad
with another value would round it onto the input's grid (or clip it), and another mode or an index
tensor is no view of those values, so their regions stay float with this module's reason.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch.nn.functional as F
from torch import fx, nn

from qplug_core.flows.split_pieces import NOT_READ_BY_INDEX, is_split, read_by_index, split_of
from qplug_core.flows.tags import VALUE_KIND

_CONSTANT_PADS = (nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d)  # ZeroPadNd subclass these
_PAD_SIGNATURE = inspect.signature(F.pad)


def _basic_index(index: Any) -> bool:
    """Ints, slices of ints, None and Ellipsis (or a tuple of them): a view of the values."""
    if isinstance(index, tuple):
        return all(_basic_index(i) for i in index)
    if isinstance(index, slice):
        return all(b is None or isinstance(b, int) for b in (index.start, index.stop, index.step))
    return index is None or index is Ellipsis or isinstance(index, int)


def _pad_value_and_mode(node: fx.Node) -> tuple[Any, Any]:
    call = _PAD_SIGNATURE.bind(*node.args, **node.kwargs).arguments
    return call.get("value"), call.get("mode", "constant")


def inexact_share_reason(node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    """Why the share-qparams op at ``node`` would change values if it kept its input's qparams, or
    None when it keeps them exactly (every op other than a pad, a getitem or a split does)."""
    if node.op == "call_module" and isinstance(modules.get(str(node.target)), _CONSTANT_PADS):
        value = modules[str(node.target)].value
        return None if value == 0 else f"it pads with {value}, not 0: not exact on its input's int8 grid"
    if is_split(node) and not read_by_index(node):
        return NOT_READ_BY_INDEX
    if node.op != "call_function":
        return None
    if node.target is F.pad:
        value, mode = _pad_value_and_mode(node)
        if mode != "constant":
            return f"padding mode {mode!r} stays float (int8 takes constant zero padding only)"
        if value not in (None, 0):
            return f"it pads with {value}, not 0: not exact on its input's int8 grid"
        return None
    if node.target is operator.getitem and split_of(node) is None:  # a split's piece is exact
        source, index = node.args[0], node.args[1]
        if not isinstance(source, fx.Node) or source.meta.get(VALUE_KIND, "float_tensor") != "float_tensor":
            return "it reads an item of a tuple or list, not a slice of a tensor"
        if not _basic_index(index):
            return "its index is a tensor or a computed value, not a basic slice (ints, slices, None, ...)"
    return None
