"""Embedding ids checked before a compiled partition runs them.

A float ``nn.Embedding`` / ``nn.EmbeddingBag`` raises for an id below 0 or past its rows. A runtime
does not: ONNX's Gather counts -1 from the end (ONNX Runtime answered with the last row) and
OpenVINO's gives zeros past the end, so an int8 model served a feature pipeline's "missing" id -1
where the float model failed. :class:`IdBounds` reads the ids each table of a partition gets (one
min/max per id tensor) and raises :class:`InputMismatchError` for the ones the table would refuse.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from qplug_core.errors import InputMismatchError
from qplug_core.ir.failed_calls import quiet_call

_TABLES = (nn.Embedding, nn.EmbeddingBag)


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
    """The ids of a partition's tables, computed from its inputs by the ops that lead to them
    (the inputs themselves, or slices: ``x_cat[:, 2]``) and checked against each table's rows."""

    def __init__(self, partition: fx.GraphModule, ids: list[fx.Node], tables: list[tuple[str, str, int, bool]]):
        self._tables = tables  # (input name, table name, rows, ids handed on as given) per id tensor
        placeholders = [n for n in partition.graph.nodes if n.op == "placeholder"]
        if all(n in placeholders for n in ids):  # inputs as they are: no graph to run (batch 1 counts)
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


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it is computed from."""
    seen, todo = {node}, [node]
    while todo:
        for parent in todo.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


__all__ = ["IdBounds"]
