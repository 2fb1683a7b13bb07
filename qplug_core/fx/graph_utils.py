"""Small GraphModule helpers shared by the flow passes."""

from __future__ import annotations

from torch import fx, nn


def set_submodule(gm: fx.GraphModule, qualified_name: str, module: nn.Module) -> None:
    """Put ``module`` at a dotted name, replacing what was there (the parent must exist)."""
    parent_name, _, attr = qualified_name.rpartition(".")
    parent = gm.get_submodule(parent_name) if parent_name else gm
    setattr(parent, attr, module)


def is_module_call(gm: fx.GraphModule, node: object, cls: type | tuple[type, ...]) -> bool:
    """Whether ``node`` calls a submodule that is an instance of ``cls``."""
    return (isinstance(node, fx.Node) and node.op == "call_module"
            and isinstance(gm.get_submodule(node.target), cls))
