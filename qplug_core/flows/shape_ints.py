"""Python ints crossing a partition's boundary are recomputed on each side of it.

torch.export leaves a dynamic size as shape arithmetic (``sym_size``, then ``+``, ``//``...) read
by the views and reshapes that use it; symbolic tracing records ``x.shape``, ``x.size(1)`` and
``getitem`` for the same. Grouped into partitions, such an int may be computed in one
and read in another, or outside: a compiled partition is a serialized model (ONNX, an SDK's graph)
whose inputs and outputs are tensors, so the exporter refused it (``'int' object has no attribute
'name'``, on Wav2Vec2's attention) and the partition ran in reference form. An int is cheap and
its inputs are tensors, so each side that reads it gets its own copy of the arithmetic: the
partition reads the tensor the size is taken of (a tensor input the exporter turns into ``Shape``)
and the rest of the graph takes the size of a tensor the partition returns.
"""

from __future__ import annotations

import operator

from torch import fx

from qplug_core.flows.tags import VALUE_KIND

#: the group of the nodes in no partition
_OUTSIDE = -1


#: size queries symbolic tracing records as method calls (``x.size(1)``, ``x.size()``)
_SIZE_METHODS = frozenset({"size", "dim", "numel"})


def _is_int(node: fx.Node) -> bool:
    """Whether ``node`` computes a Python number, or the shape its numbers are read from
    (``x.shape``, ``x.size()``): not a tensor, and not another tuple (an op's outputs, read through
    ``getitem``). Its value kind is what a saved graph keeps (``qp.load`` has no fake values)."""
    if node.meta.get(VALUE_KIND) != "other":
        return False
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    if node.op != "call_function":
        return False
    if node.target is getattr and node.args[1:] == ("shape",):
        return True
    return not any(user.target is operator.getitem for user in node.users)


def _recomputable(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """Whether ``node``'s arithmetic reads only tensors and other recomputable ints (not a
    forward() argument that is a Python number: :mod:`qplug_core.flows.python_inputs`)."""
    if node not in memo:
        memo[node] = _is_int(node) and all(
            _recomputable(a, memo) for a in node.all_input_nodes if a.meta.get(VALUE_KIND) == "other")
    return memo[node]


def recompute_boundary_ints(gm: fx.GraphModule, partitions: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """``partitions`` (nodes in graph order) with every int another group reads copied into that
    group, in place on ``gm``: no partition then reads or returns an int it can recompute. Copies
    sit right after their original (same inputs) and originals no longer read are erased."""
    group = {n: i for i, nodes in enumerate(partitions) for n in nodes}
    members = [list(nodes) for nodes in partitions]
    memo: dict[fx.Node, bool] = {}
    copies: dict[tuple[fx.Node, int], fx.Node] = {}

    def copy_in(node: fx.Node, target: int) -> fx.Node:
        if group.get(node, _OUTSIDE) == target or not _recomputable(node, memo):
            return node
        if (node, target) not in copies:
            with gm.graph.inserting_after(node):
                clone = gm.graph.node_copy(node, lambda a: copy_in(a, target) if _is_int(a) else a)
            copies[node, target] = clone
            if target != _OUTSIDE:
                group[clone] = target
                members[target].append(clone)
        return copies[node, target]

    rewired: set[fx.Node] = set()  # originals some reader left, and then the ints they read
    for node in [node for node in gm.graph.nodes if _recomputable(node, memo)]:
        for user in list(node.users):
            reader = group.get(user, _OUTSIDE)
            if reader != group.get(node, _OUTSIDE):
                user.replace_input_with(node, copy_in(node, reader))
                rewired.add(node)
    for node in reversed(list(gm.graph.nodes)):  # users before what they read
        if node in rewired and not node.users:
            rewired.update(a for a in node.all_input_nodes if _recomputable(a, memo))
            gm.graph.erase_node(node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [sorted((n for n in nodes if n in order), key=order.__getitem__) for nodes in members]


__all__ = ["recompute_boundary_ints"]
