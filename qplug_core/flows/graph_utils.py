"""Small GraphModule helpers shared by the flow passes."""

from __future__ import annotations

from torch import fx


def is_module_call(gm: fx.GraphModule, node: object, cls: type | tuple[type, ...]) -> bool:
    """Whether ``node`` calls a submodule that is an instance of ``cls``."""
    return (isinstance(node, fx.Node) and node.op == "call_module"
            and isinstance(gm.get_submodule(node.target), cls))
