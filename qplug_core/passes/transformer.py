"""A torch.fx.Transformer that keeps ``node.meta`` and tells whether it rewrote anything.

``Transformer`` rebuilds the graph and only carries over a few tracing fields (stack trace,
module stack); shape/dtype metadata (``val``, ``tensor_meta``) and custom keys would be lost,
which breaks later passes (dtype-based partitioning, observers). This base copies them.
"""

from __future__ import annotations

from typing import Any

from torch import fx
from torch.fx import GraphModule, Node

from qplug_core.passes.base import PassBase, PassResult

__all__ = ["MetaTransformer", "TransformerPass", "PROVENANCE_KEYS"]

# Keys that describe where a node came from: safe to give to every node created from it, even
# when the new node computes something else (one-to-many decompositions).
PROVENANCE_KEYS = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node", "torch_fn")


class MetaTransformer(fx.Transformer):
    """Transformer whose new nodes inherit the meta of the node they were created from.

    The node that stands for the old node's value gets a copy of all its meta; other nodes
    created while transforming it get only :data:`PROVENANCE_KEYS`. Subclasses set
    ``self.changed = True`` when they rewrite something.
    """

    def __init__(self, module: GraphModule) -> None:
        super().__init__(module)
        self.changed = False

    def run_node(self, n: Node) -> Any:
        before = len(self.new_graph.nodes)
        result = super().run_node(n)
        created = len(self.new_graph.nodes) - before
        if created == 0:
            return result
        main = result.node if isinstance(result, fx.Proxy) else None
        for i, new in enumerate(reversed(self.new_graph.nodes)):
            if i >= created:
                break
            keys = n.meta.keys() if new is main else (k for k in PROVENANCE_KEYS if k in n.meta)
            for k in keys:
                new.meta.setdefault(k, n.meta[k])
        return result


class TransformerPass(PassBase):
    """A pass that runs a :class:`MetaTransformer` and reports whether it changed anything."""

    def make_transformer(self, graph_module: GraphModule) -> MetaTransformer:
        """Return the transformer to run on ``graph_module``."""
        raise NotImplementedError(f"{self.name} must implement make_transformer()")

    def call(self, graph_module: GraphModule) -> PassResult:
        transformer = self.make_transformer(graph_module)
        new_gm = transformer.transform()
        if not transformer.changed:
            return PassResult(graph_module, False)
        new_gm.graph.lint()
        return PassResult(new_gm, True)
