"""Many-to-one rewriting: replace every match of a pattern graph by a replacement graph.

Mirrors ``torch.fx.subgraph_rewriter.replace_pattern_with_filters`` on top of our own
:class:`~qplug_core.ir.subgraph_matcher.SubgraphMatcher`: pattern and replacement are callables
(symbolically traced), Graphs or GraphModules using the same ops as the target graph (export
them with ``aten_graph_of`` for ATen graphs); overlapping matches are dropped by the matcher; a
match whose input was produced by an earlier replacement is re-pointed at the new node; the
replacement's ``get_attr`` / ``call_module`` targets are copied into the module when missing.
Works in place. New nodes carry no meta: use ``nodes_map`` / ``replacements`` to carry it over.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.fx import Graph, GraphModule, Node

from qplug_core.errors import GraphError
from qplug_core.ir.subgraph_matcher import InternalMatch, SubgraphMatcher, pattern_graph_from

__all__ = ["ReplacedPatterns", "replace_pattern"]

MatchFilter = Callable[[InternalMatch, Graph, Graph], bool]


@dataclass
class ReplacedPatterns:
    """One replaced match: where it was found, what it matched, what was inserted."""

    anchor: Node
    nodes_map: dict[Node, Node]
    replacements: list[Node]


def _insert_point(graph: Graph, match: InternalMatch) -> Node:
    """Right before the first user of the match's results (else right after the match)."""
    users = {u for n in match.returning_nodes for u in n.users}
    returning = set(match.returning_nodes)
    after: Node | None = None
    for node in graph.nodes:
        if node in users:
            return node
        if node in returning:
            after = node.next
    if after is None:  # pragma: no cover - a returning node is always followed by output
        raise GraphError("cannot find where to insert the replacement; the match returns nothing")
    return after


def _copy_missing_attributes(gm: GraphModule, replacement: torch.nn.Module) -> None:
    gm.delete_all_unused_submodules()
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        target = str(node.target)
        if _lookup(gm, target) is not None:
            continue  # the module's own attribute wins
        value = _lookup(replacement, target)
        if value is None:
            raise GraphError(f"replacement uses {node.op} {target!r}, which exists neither in the "
                             "module nor in the replacement; add it to the replacement module.",
                             node=node.name)
        parent_path, _, attr = target.rpartition(".")
        if isinstance(value, torch.nn.Module):
            gm.add_submodule(target, copy.deepcopy(value))
        else:
            setattr(gm.get_submodule(parent_path), attr, copy.deepcopy(value))


def _lookup(module: torch.nn.Module, target: str) -> Any:
    parent_path, _, attr = target.rpartition(".")
    try:
        parent = module.get_submodule(parent_path)
    except AttributeError:
        return None
    return getattr(parent, attr, None)


def replace_pattern(gm: GraphModule, pattern: Callable[..., Any] | Graph | GraphModule,
                    replacement: Callable[..., Any] | Graph | GraphModule,
                    match_filters: Sequence[MatchFilter] | None = None,
                    ignore_literals: bool = False) -> list[ReplacedPatterns]:
    """Replace every (filtered) match of ``pattern`` in ``gm`` by ``replacement``, in place."""
    graph = gm.graph
    pattern_graph = pattern_graph_from(pattern)
    replacement_graph = pattern_graph_from(replacement)
    matcher = SubgraphMatcher(pattern_graph, match_output=False, match_placeholder=False,
                              remove_overlapping_matches=True, ignore_literals=ignore_literals)
    matches = [m for m in matcher.match(graph)
               if all(f(m, graph, pattern_graph) for f in (match_filters or ()))]
    replacement_inputs = [n for n in replacement_graph.nodes if n.op == "placeholder"]
    changed: dict[Node, Node] = {}  # returning node of an earlier match -> its replacement
    results: list[ReplacedPatterns] = []
    for match in matches:
        if len(match.placeholder_nodes) != len(replacement_inputs):
            raise GraphError(f"pattern has {len(match.placeholder_nodes)} inputs but the "
                             f"replacement takes {len(replacement_inputs)}; give both the same "
                             "parameters in the same order.")
        val_map: dict[Node, Any] = {}
        for k, (rn, gn) in enumerate(zip(replacement_inputs, match.placeholder_nodes)):
            new = changed.get(gn, gn) if isinstance(gn, Node) else gn
            if new is not gn:
                match.placeholder_nodes[k] = new
                for pn, mapped in match.nodes_map.items():
                    if mapped is gn:
                        match.nodes_map[pn] = new
            val_map[rn] = new
        with graph.inserting_before(_insert_point(graph, match)):
            returned = graph.graph_copy(replacement_graph, val_map)
        copied = (returned,) if isinstance(returned, Node) else tuple(returned or ())
        if len(copied) != len(match.returning_nodes):
            raise GraphError(f"pattern returns {len(match.returning_nodes)} values but the "
                             f"replacement returns {len(copied)}; they must return the same number.")
        inputs = set(match.placeholder_nodes)
        replacements = [v for v in val_map.values() if isinstance(v, Node) and v not in inputs]
        for gn, new in zip(match.returning_nodes, copied):
            gn.replace_all_uses_with(new)
            changed[gn] = new
        for pn in reversed(pattern_graph.nodes):
            if pn.op not in ("placeholder", "output"):
                graph.erase_node(match.nodes_map[pn])
        results.append(ReplacedPatterns(anchor=match.anchors[0], nodes_map=match.nodes_map,
                                        replacements=replacements))
    gm.recompile()
    if isinstance(replacement, torch.nn.Module):
        _copy_missing_attributes(gm, replacement)
        gm.recompile()
    return results
