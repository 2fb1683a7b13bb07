"""Fold computations that depend only on parameters, buffers and literals into new buffers.

Typical case: a weight transform in ``forward`` (``self.w.t() * 2``) that would otherwise run on
every call and hide the real weight from the quantizer. Anything reachable from a placeholder,
impure, random, or a module call is never folded. Each folded value becomes a buffer named
``_folded_<node name>`` read through a ``get_attr`` node that keeps the folded node's meta.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from qplug_core.ir.attributes import fetch_attribute
from qplug_core.passes.base import PassBase, PassResult

__all__ = ["ConstantFoldingPass"]

_RANDOM = frozenset({torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like,
                     torch.randn_like, torch.randint_like, torch.bernoulli, torch.normal,
                     torch.multinomial, torch.poisson, torch.dropout,
                     torch.nn.functional.dropout})


def _is_foldable_op(node: Node) -> bool:
    if node.op not in ("call_function", "call_method") or node.is_impure():
        return False
    if node.target in _RANDOM:
        return False
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded not in tags


def _constant_nodes(gm: GraphModule) -> list[Node]:
    """Nodes computed only from get_attr nodes and literals, in graph order."""
    constant: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (_is_foldable_op(node)
                                     and all(a in constant for a in node.all_input_nodes)):
            constant.add(node)
    return [n for n in gm.graph.nodes if n in constant]


def _evaluate(gm: GraphModule, nodes: list[Node]) -> dict[Node, Any]:
    env: dict[Node, Any] = {}

    def load(a: Any) -> Any:
        return env[a] if isinstance(a, Node) else a

    with torch.no_grad():
        for node in nodes:
            args = torch.fx.node.map_aggregate(node.args, load)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, load)
            if node.op == "get_attr":
                env[node] = fetch_attribute(gm, str(node.target))
            elif node.op == "call_function":
                env[node] = node.target(*args, **kwargs)
            else:
                self_obj, *rest = args
                env[node] = getattr(self_obj, str(node.target))(*rest, **kwargs)
    return env


def _fresh_name(gm: GraphModule, base: str) -> str:
    name, i = base, 1
    while hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    return name


class ConstantFoldingPass(PassBase):
    """Replace parameter-only subgraphs with precomputed buffers."""

    def call(self, graph_module: GraphModule) -> PassResult:
        nodes = _constant_nodes(graph_module)
        constant = set(nodes)
        # Fold only the frontier: computed constants read by something that is not constant.
        frontier = [n for n in nodes if n.op != "get_attr"
                    and any(u not in constant for u in n.users)]
        if not frontier:
            return PassResult(graph_module, False)
        env = _evaluate(graph_module, nodes)
        graph = graph_module.graph
        folded = False
        for node in frontier:
            value = env[node]
            if not isinstance(value, torch.Tensor):
                continue  # sizes and other Python values stay computed
            name = _fresh_name(graph_module, f"_folded_{node.name}")
            graph_module.register_buffer(name, value.detach().clone())
            with graph.inserting_before(node):
                new = graph.get_attr(name)
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            folded = True
        for node in reversed(nodes):
            if not node.users and node.graph is graph:
                graph.erase_node(node)
        graph.lint()
        graph_module.recompile()
        return PassResult(graph_module, folded)
