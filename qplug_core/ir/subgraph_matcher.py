"""Match a pattern *graph* against a larger torch.fx graph (for subgraph rewriting).

Same semantics as ``torch.fx.passes.utils.matcher_utils.SubgraphMatcher``, our own implementation
(runtime code must not depend on ``torch.fx.passes``). Pattern placeholders are wildcards, the
pattern's sink nodes are anchors, and from each anchor candidate the pattern and the graph are
walked backwards together through args and kwargs. A match is kept only if it does not leak
(internal nodes have no users outside the match, except nodes the pattern returns) and fusing it
would not create a cycle. Works on symbolically traced graphs and on ATen graphs from
``torch.export``; for the latter, export the pattern too (:func:`aten_graph_of`).

One deliberate difference: when a branch fails to match, torch keeps its tentative node pairs in
the match under way (its restore only rebinds a local); here they are undone. The outcome is the
same, since a failed branch fails its whole anchor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from qplug_core.errors import GraphError, PatternError, TraceError
from qplug_core.ir.cycles import forms_cycle

__all__ = ["InternalMatch", "SubgraphMatcher", "aten_graph_of", "pattern_graph_from"]


@dataclass
class InternalMatch:
    """A match of a pattern graph: pattern node -> graph node, plus the match's boundary."""

    anchors: list[fx.Node]
    nodes_map: dict[fx.Node, Any] = field(default_factory=dict)
    placeholder_nodes: list[Any] = field(default_factory=list)
    returning_nodes: list[fx.Node] = field(default_factory=list)
    name_node_map: dict[str, fx.Node] = field(default_factory=dict)


def pattern_graph_from(pattern: fx.Graph | fx.GraphModule | Callable[..., Any]) -> fx.Graph:
    """The ``fx.Graph`` of a pattern given as a Graph, a GraphModule or a traceable callable."""
    if isinstance(pattern, fx.Graph):
        return pattern
    if isinstance(pattern, fx.GraphModule):
        return pattern.graph
    if callable(pattern):
        try:
            return fx.symbolic_trace(pattern).graph
        except Exception as error:  # tracing can fail in many torch-specific ways
            raise TraceError(f"Cannot symbolically trace the pattern {pattern!r}: {error}; give "
                             "the pattern as an fx.Graph or GraphModule instead",
                             module=getattr(pattern, "__name__", type(pattern).__name__)) from error
    raise PatternError(f"A pattern graph must be an fx.Graph, a GraphModule or a callable, got "
                       f"{type(pattern).__name__}", pattern=pattern)


class _CallableModule(torch.nn.Module):
    """Wraps a plain function so that ``torch.export`` (which needs a Module) can capture it."""

    def __init__(self, fn: Callable[..., Any]):
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def aten_graph_of(fn: Callable[..., Any], example_inputs: Sequence[Any]) -> fx.GraphModule:
    """The ATen-level GraphModule of ``fn`` captured by ``torch.export`` on ``example_inputs``.

    Export patterns with this too when matching exported graphs, so both sides use
    ``torch.ops.aten.*`` targets.
    """
    module = fn if isinstance(fn, torch.nn.Module) else _CallableModule(fn)
    try:
        return torch.export.export(module, tuple(example_inputs)).graph_module
    except Exception as error:  # export raises many private exception types
        raise TraceError(f"torch.export could not capture {fn!r}: {error}",
                         module=type(module).__name__) from error


def _attribute(graph: fx.Graph, target: str) -> Any:
    owner = graph.owning_module
    if owner is None:
        raise GraphError(f"Cannot read attribute {target!r}: its graph has no owning module; "
                         "match GraphModule graphs when patterns contain get_attr nodes")
    value: Any = owner
    for name in target.split("."):
        value = getattr(value, name)
    return value


def _normalized_args(node: fx.Node) -> list[Any] | None:
    """All arguments of an ATen op call in schema order, defaults filled, or None if not ATen."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or not isinstance(schema, torch.FunctionSchema):
        return None
    values = []
    for position, argument in enumerate(schema.arguments):
        if argument.name in node.kwargs:
            values.append(node.kwargs[argument.name])
        elif not argument.kwarg_only and position < len(node.args):
            values.append(node.args[position])
        else:
            values.append(argument.default_value)
    return values


class _Attempt:
    """The pattern -> graph pairs of one match under construction, with an undo trail."""

    def __init__(self, nodes_map: dict[fx.Node, Any] | None = None):
        self.nodes_map: dict[fx.Node, Any] = dict(nodes_map or {})
        self.used: set[fx.Node] = {v for v in self.nodes_map.values() if isinstance(v, fx.Node)}
        self.trail: list[fx.Node] = []

    def bind(self, pattern_node: fx.Node, value: Any) -> None:
        self.nodes_map[pattern_node] = value
        if isinstance(value, fx.Node):
            self.used.add(value)
        self.trail.append(pattern_node)

    def undo_to(self, mark: int) -> None:
        while len(self.trail) > mark:
            value = self.nodes_map.pop(self.trail.pop())
            if isinstance(value, fx.Node):
                self.used.discard(value)


class SubgraphMatcher:
    """Find every occurrence of ``pattern_graph`` in a graph.

    ``match_output``: the pattern's output node must match the graph's output node.
    ``match_placeholder``: placeholders must match placeholders instead of being wildcards.
    ``remove_overlapping_matches``: keep only the first of matches sharing a non-input node.
    ``ignore_literals``: literal arguments are wildcards instead of being compared.
    """

    def __init__(self, pattern_graph: fx.Graph | fx.GraphModule | Callable[..., Any],
                 match_output: bool = False, match_placeholder: bool = False,
                 remove_overlapping_matches: bool = True, ignore_literals: bool = False):
        self.pattern = pattern_graph_from(pattern_graph)
        self.match_output = match_output
        self.match_placeholder = match_placeholder
        self.remove_overlapping_matches = remove_overlapping_matches
        self.ignore_literals = ignore_literals

        nodes = list(self.pattern.nodes)
        if not nodes:
            raise PatternError("SubgraphMatcher needs a non-empty pattern graph",
                               pattern=self.pattern)
        for node in nodes:
            if node.op != "output" and not node.is_impure() and not node.users:
                raise PatternError(f"Pattern node {node.name!r} is dead code (its value is never "
                                   "used); return it from the pattern or remove it",
                                   pattern=self.pattern)
        output = nodes[-1]
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.returning_nodes: list[fx.Node] = output.all_input_nodes
        if match_output:
            self.anchors = [output]
        else:
            self.anchors = [n for n in output.all_input_nodes if len(n.users) == 1]

    # -- node comparison -----------------------------------------------------------------------

    def _same_attribute(self, pattern_node: fx.Node, node: fx.Node) -> bool:
        expected = _attribute(pattern_node.graph, pattern_node.target)  # type: ignore[arg-type]
        actual = _attribute(node.graph, node.target)  # type: ignore[arg-type]
        if type(expected) is not type(actual):
            return False
        if isinstance(expected, torch.Tensor):
            return True  # constant tensors match by kind, not by value
        raise PatternError(f"Cannot compare get_attr {pattern_node.target!r} of type "
                           f"{type(expected).__name__}; only tensor attributes are supported",
                           pattern=self.pattern)

    def _nodes_equal(self, pattern_node: fx.Node, node: fx.Node) -> bool:
        if pattern_node.op == "placeholder" and not self.match_placeholder:
            return True
        if pattern_node.op != node.op:
            return False
        if node.op in ("placeholder", "output"):
            return True
        if node.op == "get_attr":
            return self._same_attribute(pattern_node, node)
        return pattern_node.target == node.target

    # -- recursive matching --------------------------------------------------------------------

    def _match_literal(self, expected: Any, actual: Any, attempt: _Attempt) -> bool:
        if isinstance(expected, fx.Node):
            if expected.op != "placeholder":
                return False
            if expected in attempt.nodes_map:
                return attempt.nodes_map[expected] == actual
            attempt.bind(expected, actual)
            return True
        if isinstance(actual, fx.Node):
            return False
        return type(actual) is type(expected) and actual == expected

    def _match_args(self, expected: Sequence[Any], actual: Sequence[Any],
                    attempt: _Attempt) -> bool:
        if len(expected) != len(actual):
            return False
        for pattern_arg, arg in zip(expected, actual):
            if isinstance(pattern_arg, fx.Node) and isinstance(arg, fx.Node):
                matched = self._match_node(pattern_arg, arg, attempt)
            elif isinstance(pattern_arg, (list, tuple)) and isinstance(arg, (list, tuple)):
                matched = self._match_args(pattern_arg, arg, attempt)
            else:
                matched = self._match_literal(pattern_arg, arg, attempt) or self.ignore_literals
            if not matched:
                return False
        return True

    def _flat_args(self, pattern_node: fx.Node, node: fx.Node
                   ) -> tuple[list[Any], list[Any]] | None:
        same_shape = (len(pattern_node.args) == len(node.args)
                      and list(pattern_node.kwargs) == list(node.kwargs))
        if not same_shape:
            expected = _normalized_args(pattern_node)
            if expected is None:
                return None
            actual = _normalized_args(node)
            return (expected, actual) if actual is not None else None
        return ([*pattern_node.args, *pattern_node.kwargs.values()],
                [*node.args, *node.kwargs.values()])

    def _match_node(self, pattern_node: fx.Node, node: fx.Node, attempt: _Attempt) -> bool:
        if pattern_node in attempt.nodes_map:
            return attempt.nodes_map[pattern_node] is node
        if node in attempt.used or not self._nodes_equal(pattern_node, node):
            return False
        mark = len(attempt.trail)
        attempt.bind(pattern_node, node)
        if pattern_node.op == "placeholder":
            return True
        flat = self._flat_args(pattern_node, node)
        if flat is not None and self._match_args(*flat, attempt):
            return True
        attempt.undo_to(mark)
        return False

    # -- whole-graph search --------------------------------------------------------------------

    def _is_contained(self, nodes_map: dict[fx.Node, Any]) -> bool:
        inside = {node: p for p, node in nodes_map.items() if p.op != "placeholder"}
        returning = set(self.returning_nodes)
        return all(p in returning or all(user in inside for user in node.users)
                   for node, p in inside.items())

    def _compute_nodes(self, match: InternalMatch) -> list[fx.Node]:
        return [node for p, node in match.nodes_map.items()
                if p.op not in ("placeholder", "output")]

    def _without_overlaps(self, matches: list[InternalMatch]) -> list[InternalMatch]:
        taken: set[fx.Node] = set()
        kept = []
        for match in matches:
            nodes = self._compute_nodes(match)
            if not taken.intersection(nodes):
                kept.append(match)
                taken.update(nodes)
        return kept

    def match(self, graph: fx.Graph | fx.GraphModule) -> list[InternalMatch]:
        """Every self-contained, cycle-free match, in the order their anchors appear in ``graph``.

        Anchors are matched one after the other with backtracking over their candidates, so a
        pattern with several outputs finds every consistent combination.
        """
        if isinstance(graph, fx.GraphModule):
            graph = graph.graph
        candidates = [(anchor, [n for n in graph.nodes if self._nodes_equal(anchor, n)])
                      for anchor in self.anchors]
        found: list[InternalMatch] = []

        def extend(index: int, attempt: _Attempt) -> None:
            if index == len(candidates):
                nodes_map = dict(attempt.nodes_map)
                found.append(InternalMatch(
                    anchors=self.anchors, nodes_map=nodes_map,
                    placeholder_nodes=[nodes_map[p] for p in self.placeholders if p in nodes_map],
                    returning_nodes=[nodes_map[p] for p in self.returning_nodes]))
                return
            anchor, nodes = candidates[index]
            for node in nodes:
                mark = len(attempt.trail)
                if self._match_node(anchor, node, attempt):
                    extend(index + 1, attempt)
                attempt.undo_to(mark)

        if candidates:
            extend(0, _Attempt())
        matches = [m for m in found if self._is_contained(m.nodes_map)
                   and not forms_cycle(set(self._compute_nodes(m)))]
        return self._without_overlaps(matches) if self.remove_overlapping_matches else matches
