"""Which inputs of a graph index an embedding table, and which input sizes index a position table.

A token model given an id outside its vocabulary, or a sequence longer than its table of learned
positions, fails inside a lookup (torch's "Index 1044 is out of bounds", ONNX Runtime's "indices
element out of data bounds") or an add further on, where nothing names the input at fault. This
module finds, for each table lookup in a graph and in the partitions it calls (a delegated
partition's reference form), where its indices come from: an input itself (token ids), or the
positions ``0..n-1`` of an input's size ``n`` at one dimension (``arange(ids.size(1))``, or a
slice of an ``arange`` buffer as Hugging Face's ``position_ids[:, :n]``). Only ops that keep the
values (a view, an unsqueeze, a dtype change) are followed: a table indexed by anything computed
from the values (token type ids gathered from a buffer) is left out. Read only when a call failed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from qplug_core.kernels.reference import ReferenceWeighted
from qplug_core.partition.held import HoldsPartition

__all__ = ["TableLookup", "table_lookups"]

#: ops whose output holds their first argument's values (as call_method names and aten packets)
_SAME_VALUES = frozenset({"view", "reshape", "_unsafe_view", "flatten", "contiguous", "clone", "alias",
                          "detach", "to", "_to_copy", "long", "int", "type", "unsqueeze", "squeeze",
                          "expand", "permute", "transpose"})


@dataclass(frozen=True)
class TableLookup:
    """A lookup in table ``table`` (``rows`` rows), indexed by the values of input ``input`` (a
    placeholder of the top graph) or, with ``dim`` set, by the positions ``0..n-1`` of its size
    ``n`` at ``dim``."""

    table: str
    rows: int
    input: str
    dim: int | None = None


def table_lookups(gm: fx.GraphModule) -> list[TableLookup]:
    """The table lookups of ``gm`` (and of the partitions it calls) whose indices come from an input."""
    found: list[TableLookup] = []
    _collect(_Scope(gm, None, None), found)
    return found


@dataclass(frozen=True)
class _Scope:
    """A graph, and the call node (in ``parent``) that runs it as a submodule."""

    gm: fx.GraphModule
    parent: _Scope | None
    call: fx.Node | None


def _collect(scope: _Scope, found: list[TableLookup]) -> None:
    for node in scope.gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = scope.gm.get_submodule(str(node.target))
        inner = module.partition if isinstance(module, HoldsPartition) else module
        if isinstance(inner, fx.GraphModule):
            _collect(_Scope(inner, scope, node), found)
            continue
        rows = _rows(module)
        if rows is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        table = str(node.target)  # a partition's reference form keeps the model's module names
        source, origin = _origin(scope, node.args[0])
        if origin.op == "placeholder" and source.parent is None:
            found.append(TableLookup(table, rows, str(origin.target)))
        elif (position := _positions_of(source, origin)) is not None:
            found.append(TableLookup(table, rows, *position))


def _rows(module: nn.Module) -> int | None:
    """The rows of an embedding table module (float, reference form or kernel), else None."""
    if isinstance(module, ReferenceWeighted):
        module = module.module
    rows = getattr(module, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def _name(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        packet = getattr(node.target, "overloadpacket", node.target)
        return getattr(packet, "__name__", None)
    return None


def _origin(scope: _Scope, node: fx.Node, *, same_values: bool = True) -> tuple[_Scope, fx.Node]:
    """The node (and its graph) whose values ``node`` holds: through ops that keep the values
    (unless not ``same_values``: the tensor itself) and out of a partition's inputs to the
    arguments its call gives them."""
    while True:
        if same_values and _name(node) in _SAME_VALUES and node.args and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        elif node.op == "placeholder" and scope.parent is not None and scope.call is not None:
            index = [n for n in scope.gm.graph.nodes if n.op == "placeholder"].index(node)
            if index >= len(scope.call.args) or not isinstance(scope.call.args[index], fx.Node):
                return scope, node
            scope, node = scope.parent, scope.call.args[index]
        else:
            return scope, node


def _positions_of(scope: _Scope, node: fx.Node) -> tuple[str, int] | None:
    """``(input, dim)`` where ``node`` holds the positions ``0..n-1`` of that input's size ``n``."""
    if _name(node) == "arange" and node.args and isinstance(node.args[-1], fx.Node) and (
            len(node.args) == 1 or (len(node.args) == 2 and node.args[0] == 0)):
        return _size_of(scope, node.args[-1])
    if _name(node) == "getitem" and isinstance(node.args[0], fx.Node):
        stops = [s.stop for s in _slices(node.args[1]) if isinstance(s.stop, fx.Node)]
        source, base = _origin(scope, node.args[0])
        if len(stops) == 1 and (stop := _size_of(scope, stops[0])) is not None and _holds_arange(source, base):
            return stop
    return None


def _slices(index: object) -> list[slice]:
    parts = index if isinstance(index, tuple) else (index,)
    return [part for part in parts if isinstance(part, slice)]


def _size_of(scope: _Scope, node: fx.Node) -> tuple[str, int] | None:
    """``(input, dim)`` where ``node`` is ``input.size(dim)`` of an input of the top graph."""
    if _name(node) not in ("size", "sym_size") or len(node.args) != 2 or not isinstance(node.args[1], int):
        return None
    if not isinstance(node.args[0], fx.Node):
        return None
    source, origin = _origin(scope, node.args[0], same_values=False)
    if origin.op != "placeholder" or source.parent is not None:
        return None
    return str(origin.target), node.args[1]


def _holds_arange(scope: _Scope, node: fx.Node) -> bool:
    """Whether ``node`` is a buffer whose last dimension counts ``0, 1, 2, ...``."""
    if node.op != "get_attr":
        return False
    owner, _, name = str(node.target).rpartition(".")
    try:
        value = getattr(scope.gm.get_submodule(owner), name)
    except AttributeError:
        return False
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.is_floating_point() or value.numel() == 0:
        return False
    rows = value.reshape(-1, value.shape[-1])
    return bool((rows == torch.arange(value.shape[-1], dtype=value.dtype)).all())
