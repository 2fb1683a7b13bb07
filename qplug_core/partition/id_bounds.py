"""Embedding ids checked before a compiled partition runs them.

A float ``nn.Embedding`` / ``nn.EmbeddingBag`` raises for an id below 0 or past its rows. A runtime
does not: ONNX's Gather counts -1 from the end (ONNX Runtime answered with the last row) and
OpenVINO's gives zeros past the end, so an int8 model served a feature pipeline's "missing" id -1
where the float model failed. :class:`IdBounds` reads the ids each table of a partition gets (one
min/max per id tensor) and raises :class:`InputMismatchError` for the ones the table would refuse.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx, nn

from qplug_core.errors import InputMismatchError
from qplug_core.ir.failed_calls import quiet_call

_TABLES = (nn.Embedding, nn.EmbeddingBag)
#: what an id tensor is checked against: (input name, table name, rows, ids handed on as given)
_Table = tuple[str, str, int, bool]


def _table(partition: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The embedding ``node`` calls (bare, or inside the reference form's wrapper), if any."""
    if node.op != "call_module":
        return None
    module = partition.get_submodule(str(node.target))
    inner = getattr(module, "module", module)
    return inner if isinstance(inner, _TABLES) else None


def _source(node: fx.Node) -> str:
    """The partition input an id tensor comes from (itself, or the input it was sliced from)."""
    while node.op != "placeholder" and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node.name


class IdBounds:
    """The ids of a partition's tables, computed from its inputs by the ops that lead to them and
    checked against each table's rows. Ids computed from the inputs' shapes alone (a token model's
    positions) are read and checked once per input signature (the read graph ran at every call: ~60
    us of a BERT encoder's ~290 us at batch 1 on onnxruntime); ids an input's values reach, at every
    call."""

    #: input signatures whose shape-only ids are known to be in range, kept at most (then forgotten:
    #: a server meeting every sequence length of every batch size holds no set that grows forever)
    shapes_kept = 4096

    def __init__(self, partition: fx.GraphModule, ids: list[fx.Node], tables: list[_Table]):
        by_values = [_values_reach(n) for n in ids]
        self._per_call = _Ids.of(partition, ids, tables, by_values)
        self._per_shape = _Ids.of(partition, ids, tables, [not v for v in by_values])
        self._shapes_checked: set[tuple] = set()

    @classmethod
    def of(cls, partition: fx.GraphModule) -> IdBounds | None:
        """The check of ``partition``'s tables whose ids its inputs give without running a layer
        (ids a layer computes are not checked; None when it has no table to check)."""
        ids, tables = [], []
        for node in partition.graph.nodes:
            table = _table(partition, node)
            first = node.args[0] if node.args else None
            if table is None or not isinstance(first, fx.Node) \
                    or any(n.op == "call_module" for n in _ancestors(first)):
                continue
            ids.append(first)
            handed_on = all(_passes_values(n) for n in _ancestors(first))
            tables.append((_source(first), str(node.target), table.num_embeddings, handed_on))
        return cls(partition, ids, tables) if ids else None

    def check(self, inputs: tuple[torch.Tensor, ...], signature: tuple) -> None:
        """Raise :class:`InputMismatchError` for an id the float table would refuse (``signature``:
        the inputs' shapes and dtypes, ``partition.compiled.input_signature``)."""
        if self._per_call is not None:
            self._per_call.check(inputs)
        if self._per_shape is not None and signature not in self._shapes_checked:
            self._per_shape.check(inputs)
            if len(self._shapes_checked) >= self.shapes_kept:
                self._shapes_checked.clear()
            self._shapes_checked.add(signature)


class _Ids:
    """Some id tensors of a partition and the tables they index, read from its inputs: the inputs
    themselves (no graph to run; batch 1 counts), or by the ops that lead to them (slices
    ``x_cat[:, 2]``, positions ``arange(length)``)."""

    def __init__(self, partition: fx.GraphModule, ids: list[fx.Node], tables: list[_Table]):
        self._tables = tables
        placeholders = [n for n in partition.graph.nodes if n.op == "placeholder"]
        if all(n in placeholders for n in ids):
            self._positions: list[int] | None = [placeholders.index(n) for n in ids]
            return
        self._positions = None
        needed = set().union(*(_ancestors(n) for n in ids))
        graph, copies = fx.Graph(), {}
        for node in partition.graph.nodes:  # every input (the call's signature), the ops to the ids
            if node.op == "placeholder" or node in needed:
                copies[node] = graph.node_copy(node, copies.__getitem__)
        graph.output(tuple(copies[n] for n in ids))
        self._read = fx.GraphModule(partition, graph)

    @classmethod
    def of(cls, partition: fx.GraphModule, ids: list[fx.Node], tables: list[_Table], chosen: list[bool]
           ) -> _Ids | None:
        """The ``chosen`` ones of ``ids`` (None if none is)."""
        picked = [k for k, keep in enumerate(chosen) if keep]
        return cls(partition, [ids[k] for k in picked], [tables[k] for k in picked]) if picked else None

    def check(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Raise :class:`InputMismatchError` for an id the float table would refuse."""
        if self._positions is None:
            try:
                read = quiet_call(self._read, inputs)
            except Exception:  # noqa: BLE001 - inputs the ops cannot take: the partition's call says why
                return
        else:
            read = [inputs[i] for i in self._positions]
        for ids, (name, table, rows, handed_on) in zip(read, self._tables):
            if ids.numel() == 0 or ids.is_floating_point():
                continue
            low, high = (int(v) for v in torch.aminmax(ids))
            if (low < 0 or high >= rows) and handed_on:
                raise InputMismatchError(
                    f"input {name!r} holds ids from {low} to {high}, but the table {table!r} it indexes has "
                    f"{rows} rows (ids 0 to {rows - 1}): map missing or unknown ids to a row of the table "
                    "before calling the model (the float model raises on them too)")
            if low < 0 or high >= rows:
                raise InputMismatchError(
                    f"input {name!r} is too long for the table {table!r}: the ids the model computes from it "
                    f"(its positions, say) run from {low} to {high}, and the table has {rows} rows; truncate or "
                    "split the input (the float model raises on it too)")


#: ops that hand on (part of) an input's values as ids: slices, views, integer casts
_VALUE_OPS = frozenset({operator.getitem, torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze,
                        "__getitem__", "view", "reshape", "flatten", "squeeze", "unsqueeze", "contiguous",
                        "long", "int", "to"})


def _passes_values(node: fx.Node) -> bool:
    """Whether ``node`` is an input or hands on an input's values. Ids computed otherwise (the
    positions ``arange(ids.shape[1])`` of a token model) are not the caller's ids: an out-of-range
    one is an input too long for the table, and is named so."""
    return node.op == "placeholder" or (node.op in ("call_function", "call_method") and node.target in _VALUE_OPS)


#: ops that read an input's shape, dtype or device, not its values
_METADATA_METHODS = frozenset({"size", "dim", "numel"})
_METADATA_FUNCTIONS = frozenset({len, torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default})
_METADATA_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim"})


def _reads_metadata(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    if node.op != "call_function":
        return False
    if node.target is getattr:
        return len(node.args) == 2 and node.args[1] in _METADATA_ATTRIBUTES
    return node.target in _METADATA_FUNCTIONS


def _values_reach(node: fx.Node) -> bool:
    """Whether an input's values reach ``node`` (not only its shape, dtype or device)."""
    return any(n.op == "placeholder" for n in _ancestors(node, stop=_reads_metadata))


def _ancestors(node: fx.Node, stop: Callable[[fx.Node], bool] = lambda n: False) -> set[fx.Node]:
    """``node`` and every node it is computed from (not those only a ``stop`` node reads)."""
    seen, todo = {node}, [node]
    while todo:
        current = todo.pop()
        if stop(current):
            continue
        for parent in current.all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


__all__ = ["IdBounds"]
