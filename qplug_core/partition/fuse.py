"""Turn groups of nodes into submodules called through ``call_module``.

Each group becomes a GraphModule whose inputs are the values the group reads from outside and
whose outputs are the values read after it (a tuple unpacked by ``getitem`` when there are
several). The caller's graph is then re-sorted topologically, because the call has to sit after
all of its inputs and before all users of its outputs, which no single original position
guarantees. The groups must be disjoint and must not form a dependency cycle (a path leaving a
group and coming back into it); both are checked and refused with a :class:`GraphError`, as
torch.fx refuses them, because fusing such a group cannot give a valid graph.

``attributes_inside=True`` (a partition a runtime compiles) reads the attributes a group reads
(parameters, buffers, folded constants: ``get_attr`` nodes, which no partition holds) inside its
submodule instead of taking them as inputs: they are then constants of the compiled model, not
tensors fed to it at every call. An attribute the group slices to a size computed from its inputs
(a position-id table cut to the sequence length) stays an input: as a constant it would bound
that size from above, and the exporter would then fix it (a session per sequence length).
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch
from torch.fx import Graph, GraphModule, Node

from qplug_core.errors import GraphError
from qplug_core.ir.cycles import forms_cycle

__all__ = ["build_submodule", "fuse_by_partitions", "stable_topological_sort"]

aten = torch.ops.aten


def build_submodule(gm: GraphModule, nodes: list[Node], name: str, *, attributes_inside: bool = False
                    ) -> tuple[GraphModule, list[Node], list[Node]]:
    """``nodes`` (in graph order) as a GraphModule of their own, with the outside values they
    read (its placeholders, in order; the attributes among them read inside it instead with
    ``attributes_inside``) and the ones of them read outside (its outputs); ``gm`` is left as it
    is (the submodule shares its attributes)."""
    members = set(nodes)
    inputs: dict[Node, None] = {}
    for node in nodes:
        for a in node.all_input_nodes:
            if a not in members:
                inputs.setdefault(a)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    sub = Graph()
    env: dict[Node, Node] = {}
    for a in inputs:
        if attributes_inside and a.op == "get_attr" and not _sliced_to_a_size(a):
            env[a] = sub.node_copy(a)  # its name kept: the exported model's name of the constant
        else:
            env[a] = sub.placeholder(a.name)
            env[a].meta.update(a.meta)
    for node in nodes:
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    taken = [a for a in inputs if env[a].op == "placeholder"]
    return GraphModule(gm, sub, class_name=name), taken, outputs


def _sliced_to_a_size(node: Node) -> bool:
    """Whether a node slices ``node`` with a bound computed in the graph (``t[:, :n]``,
    ``aten.slice(t, 1, 0, n)`` with ``n`` a node)."""
    for user in node.users:
        if user.target is operator.getitem and user.args[0] is node:
            index = user.args[1] if isinstance(user.args[1], tuple) else (user.args[1],)
            bounds = [b for s in index if isinstance(s, slice) for b in (s.start, s.stop, s.step)]
        elif user.target is aten.slice.Tensor and user.args[0] is node:
            bounds = list(user.args[2:])
        else:
            continue
        if any(isinstance(bound, Node) for bound in bounds):
            return True
    return False


def _refuse_cycle(i: int, group: Sequence[Node]) -> None:
    if forms_cycle(set(group)):
        names = [n.name for n in group]
        raise GraphError(f"partition {i} ({names}) found dependency cycles: a path leaves it and "
                         "comes back into it, so it cannot become one submodule.", node=names[0])


def _check_partitions(partitions: Sequence[Sequence[Node]]) -> None:
    """Refuse overlapping or cyclic groups before the graph is touched."""
    owner: dict[Node, int] = {}
    for i, group in enumerate(partitions):
        for node in group:
            if owner.setdefault(node, i) != i:
                raise GraphError(f"node {node.name!r} is in partitions {owner[node]} and {i}; "
                                 "partitions to fuse must not overlap.", node=node.name)
        _refuse_cycle(i, list(group))


def stable_topological_sort(graph: Graph) -> None:
    """Reorder ``graph`` so every node follows its inputs, moving as few nodes as possible."""
    placed: set[Node] = set()
    open_: set[Node] = set()
    order: list[Node] = []
    for root in graph.nodes:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in placed:
                continue
            if expanded:
                placed.add(node)
                open_.discard(node)
                order.append(node)
                continue
            if node in open_:
                raise GraphError(f"the graph has a dependency cycle through {node.name!r}",
                                 node=node.name)
            open_.add(node)
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(node.all_input_nodes) if a not in placed)
    prev = order[0]
    for node in order[1:]:
        if prev.next is not node:
            prev.append(node)
        prev = node


def fuse_by_partitions(gm: GraphModule, partitions: Sequence[Sequence[Node]],
                       prefix: str = "fused_", *, attributes_inside: bool = False) -> GraphModule:
    """Fuse each group of nodes of ``gm`` into a submodule ``<prefix><i>``; edits ``gm`` in place
    (``attributes_inside``: see the module docstring; an attribute node left unread goes)."""
    graph = gm.graph
    _check_partitions(partitions)
    position = {n: i for i, n in enumerate(graph.nodes)}
    for i, group in enumerate(partitions):
        nodes = sorted(group, key=position.__getitem__)
        if not nodes:
            continue
        bad = [n.name for n in nodes if n.op in ("placeholder", "output")]
        if bad:
            raise GraphError(f"cannot fuse placeholder/output nodes {bad}; partitions hold call "
                             "and get_attr nodes only.", node=bad[0])
        _refuse_cycle(i, nodes)  # earlier fusions can close a cycle through this group
        name = f"{prefix}{i}"
        sub, inputs, outputs = build_submodule(gm, nodes, name, attributes_inside=attributes_inside)
        gm.add_submodule(name, sub)
        with graph.inserting_after(nodes[-1]):
            call = graph.call_module(name, tuple(inputs))
        members = set(nodes)

        def outside(user: Node) -> bool:
            return user not in members

        if len(outputs) == 1:
            outputs[0].replace_all_uses_with(call, delete_user_cb=outside)
        else:
            with graph.inserting_after(call):
                for k, out in enumerate(outputs):
                    item = graph.call_function(operator.getitem, (call, k))
                    item.meta.update(out.meta)
                    out.replace_all_uses_with(item, delete_user_cb=outside)
        read = {a for node in nodes for a in node.all_input_nodes if a.op == "get_attr" and a not in members}
        for node in reversed(nodes):
            graph.erase_node(node)
        for node in read:
            if not node.users:
                graph.erase_node(node)
    stable_topological_sort(graph)
    graph.lint()
    gm.recompile()
    return gm
