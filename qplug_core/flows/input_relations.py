"""The relations between an exported program's input sizes that torch.export guarded, checked on
a call's sizes.

Besides fixed and equal sizes (:mod:`qplug_core.flows.exported_inputs`), torch.export guards what
the model's Python concluded from its dynamic sizes: HF ViT's ``interpolate_pos_encoding`` compares
the patch count with its position table, so its program holds ``H//16 * W//16 == 36``; a derived
dimension (``16*Dim("h")``) takes multiples of 16 only; a ``Dim`` has a range. The float program
refuses other sizes in its ``_guards_fn`` and pre-hook; qplug drops both, and a quantized program
ran on into a shape error deep in the graph. These relations are read as sympy expressions from
the shape environment the placeholders' fake values carry (``_guards_fn`` is generated code, not
run) and from ``range_constraints`` (:data:`EXPORT_RANGES`), and are evaluated on the call's
sizes; a size signature that passed is remembered. Only the in-memory model has them: ``qp.save``
records the fixed and equal sizes, not these.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Sequence

import sympy
import torch
from torch import fx
from torch.utils._sympy.printers import PythonPrinter
from torch.utils._sympy.solve import try_solve

from qplug_core.errors import input_mismatch
from qplug_core.flows.tags import EXPORT_RANGES

__all__ = ["SizeRelations"]

#: size signatures that passed, kept per model (a tuple of ints each; checking a new one takes ~5 ms)
_REMEMBERED = 1024


@dataclass(frozen=True)
class _Dim:
    """Dimension ``dim`` of tensor input ``tensor`` (its index among the checked ones) is ``expr``."""

    tensor: int
    dim: int
    expr: sympy.Expr
    name: str


@dataclass(frozen=True)
class _Relation:
    expr: sympy.Basic  # in the placeholders' symbols
    readable: str  # in the inputs' names, as the float program's guard says it
    builtin: type[Exception]  # what the float program raises for it


class SizeRelations:
    """What torch.export assumed of the symbolic sizes of some tensor inputs, beyond their being
    fixed or equal; ``names`` says how the user calls each size symbol."""

    def __init__(self, dims: list[_Dim], ranges: list[tuple[sympy.Expr, Any, Any, str]],
                 relations: list[_Relation], names: dict[sympy.Symbol, sympy.Symbol]) -> None:
        self.dims, self.ranges, self.relations, self.names = dims, ranges, relations, names
        self.passed: set[tuple] = set()

    @classmethod
    def of(cls, gm: fx.GraphModule, nodes: Sequence[fx.Node], labels: Sequence[str]) -> SizeRelations | None:
        """The relations of the inputs ``labels`` (placeholders ``nodes``) of a program the user
        exported (:data:`EXPORT_RANGES` recorded); ``None`` for another capture, or when none of
        their sizes is symbolic (a model loaded by ``qp.load``)."""
        if EXPORT_RANGES not in gm.meta:
            return None
        dims = [_Dim(i, d, size.node.expr, f"{label}.shape[{d}]")
                for i, (node, label) in enumerate(zip(nodes, labels))
                for d, size in enumerate(getattr(node.meta.get("val"), "shape", ()))
                if isinstance(size, torch.SymInt) and not size.node.expr.is_number]
        if not dims:
            return None
        env = _shape_env(nodes)
        names = _names(env, dims)
        known = {s for dim in dims if len(dim.expr.free_symbols) == 1 for s in dim.expr.free_symbols}
        named = {dim.expr: dim.name for dim in reversed(dims)}
        ranges = [(expr, r.lower, r.upper, named.get(expr) or _printed(expr, names))
                  for expr, r in gm.meta[EXPORT_RANGES].items() if expr in named or expr.free_symbols <= known]
        return cls(dims, ranges, _guards(env, names, known), names)

    def check(self, shapes: Sequence[torch.Size]) -> None:
        """Raise :class:`InputMismatchError` naming the first relation ``shapes`` (the checked
        tensor inputs' shapes, in order) break."""
        signature = tuple(shapes[dim.tensor][dim.dim] for dim in self.dims)
        if signature in self.passed:
            return
        values = self._symbols(shapes)
        given = {dim.expr: shapes[dim.tensor][dim.dim] for dim in self.dims}
        for expr, lower, upper, name in self.ranges:
            value = given[expr] if expr in given else expr.xreplace(values)
            if not lower <= value <= upper:
                raise input_mismatch(
                    f"{name} is {value} (input sizes {self._sizes(shapes)}), outside the range "
                    f"{_bound(lower)}..{_bound(upper)} the model was exported with (torch.export "
                    f"range_constraints); {_FIX}", RuntimeError)
        for relation in self.relations:
            if not bool(relation.expr.xreplace(values)):
                raise input_mismatch(
                    f"input sizes {self._sizes(shapes)} break `{relation.readable}`, which torch.export "
                    f"assumed of them when it captured the model (the float program refuses them too); "
                    f"{_FIX}", relation.builtin)
        if len(self.passed) < _REMEMBERED:
            self.passed.add(signature)

    def _symbols(self, shapes: Sequence[torch.Size]) -> dict[sympy.Symbol, sympy.Integer]:
        """The value of each size symbol: a dimension ``16*h`` given 128 makes ``h`` 8."""
        values: dict[sympy.Symbol, sympy.Integer] = {}
        for dim in self.dims:
            size = sympy.Integer(shapes[dim.tensor][dim.dim])
            if len(dim.expr.free_symbols) != 1:
                continue
            symbol = next(iter(dim.expr.free_symbols))
            if symbol not in values:
                plain = sympy.Dummy()  # solved over the rationals, then truncated as torch's check does
                solved = try_solve(sympy.Eq(dim.expr.xreplace({symbol: plain}), size), plain)
                if solved is None:
                    raise input_mismatch(
                        f"{dim.name} is {size}, but the model was exported for sizes of the form "
                        f"{_printed(dim.expr, self.names)} only (a derived torch.export Dim); {_FIX}", RuntimeError)
                values[symbol] = sympy.Integer(int(solved[1]))  # 18 for 4*h: h is 4
            elif dim.expr.xreplace(values) != size:
                raise input_mismatch(
                    f"{dim.name} is {size}, but the model was exported with it equal to "
                    f"{_printed(dim.expr, self.names)} = {dim.expr.xreplace(values)} (from the other input sizes "
                    f"{self._sizes(shapes)}); {_FIX}", RuntimeError)
        return values

    def _sizes(self, shapes: Sequence[torch.Size]) -> str:
        return ", ".join(f"{dim.name}={shapes[dim.tensor][dim.dim]}" for dim in self.dims)


_FIX = ("call it with sizes the exported program takes, or export it with dynamic shapes (and model "
        "code) that allow these sizes (docs/guide/export.md)")


def _shape_env(nodes: Sequence[fx.Node]) -> Any:
    for node in nodes:
        for size in getattr(node.meta.get("val"), "shape", ()):
            if isinstance(size, torch.SymInt):
                return size.node.shape_env
    return None


def _names(env: Any, dims: list[_Dim]) -> dict[sympy.Symbol, sympy.Symbol]:
    """How the user names each size symbol: the dimension it is (``x.shape[2]``, also for the
    symbol export first gave that size, before it knew ``16*h``), else its ``Dim``'s name (``h``)."""
    names: dict[sympy.Symbol, sympy.Symbol] = {}
    if env is None:
        return names
    for symbol, sources in env.var_to_sources.items():
        same = [dim for dim in dims if dim.expr == env.replace(symbol)]  # H and W once export made them equal
        same.sort(key=lambda dim: dim.dim != getattr(sources[0] if sources else None, "idx", None))
        if same:
            names[symbol] = sympy.Symbol(same[0].name, integer=True)
        elif sources and hasattr(sources[0], "source_name"):  # a Dim's name
            names[symbol] = sympy.Symbol(sources[0].source_name, integer=True)
    return names


def _guards(env: Any, names: dict[sympy.Symbol, sympy.Symbol], known: set) -> list[_Relation]:
    """The shape environment's guards and runtime asserts on the ``known`` size symbols alone
    (those on weights or data-dependent values are not the inputs'), in the placeholders' symbols."""
    if env is None:
        return []
    canonical = {symbol: env.replace(symbol) for symbol in env.var_to_range}
    found: dict[str, _Relation] = {}
    asserts = [(a.expr, RuntimeError) for listed in env.deferred_runtime_asserts.values() for a in listed]
    for expr, builtin in [(g.expr, AssertionError) for g in env.guards] + asserts:
        evaluated = expr.xreplace(canonical)
        if evaluated.free_symbols and evaluated.free_symbols <= known:
            readable = _printed(expr, names)
            found.setdefault(readable, _Relation(evaluated, readable, builtin))
    return list(found.values())


def _printed(expr: sympy.Basic, names: dict[sympy.Symbol, sympy.Symbol]) -> str:
    """``expr`` in Python with its symbols named by ``names``, without redundant parentheses
    (``x.shape[2] // 4 * (x.shape[3] // 4) == 16``)."""
    return ast.unparse(ast.parse(PythonPrinter().doprint(expr.xreplace(names)), mode="eval"))


def _bound(value: Any) -> str:
    return "inf" if not value.is_finite else str(value)
