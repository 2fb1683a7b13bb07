"""Whether fusing a set of nodes into one would create a cycle (fusion, partitioning, matching)."""

from __future__ import annotations

from torch import fx


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
