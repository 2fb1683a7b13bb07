"""Small GraphModule helpers shared by the flow passes."""

from __future__ import annotations

from torch import fx


def is_module_call(gm: fx.GraphModule, node: object, cls: type | tuple[type, ...]) -> bool:
    """Whether ``node`` calls a submodule that is an instance of ``cls``."""
    return (isinstance(node, fx.Node) and node.op == "call_module"
            and isinstance(gm.get_submodule(node.target), cls))


def forms_cycle(nodes: set[fx.Node] | frozenset[fx.Node]) -> bool:
    """True if some path leaves ``nodes`` and comes back, so fusing them would make a cycle."""
    stack = [user for node in nodes for user in node.users if user not in nodes]
    seen: set[fx.Node] = set()
    while stack:
        current = stack.pop()
        if current in nodes:
            return True
        if current in seen:
            continue
        seen.add(current)
        stack.extend(current.users)
    return False
