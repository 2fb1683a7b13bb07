"""Dead code elimination as a pass (fx's own, plus dropping submodules nothing calls any more)."""

from __future__ import annotations

from torch.fx import GraphModule

from qplug_core.passes.base import PassResult

__all__ = ["dead_code_elimination"]


def dead_code_elimination(graph_module: GraphModule) -> PassResult:
    """Erase nodes whose results are unused and that have no side effects (``Node.is_impure``)."""
    modified = graph_module.graph.eliminate_dead_code()
    if modified:
        graph_module.delete_all_unused_submodules()
        graph_module.recompile()
    return PassResult(graph_module, modified)
