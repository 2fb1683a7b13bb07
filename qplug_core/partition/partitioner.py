"""Split a graph into the largest groups of supported nodes a backend can run as one unit.

Same greedy as ``torch.fx.passes.infra.partitioner.CapabilityBasedPartitioner`` (so the same
partitions come out, see ``tests/differential``): walk the nodes in reverse topological order;
each supported node starts a partition that then tries to absorb every existing partition,
oldest first; when the node is unsupported the oldest partition tries instead. A merge that
would make the partitions cyclic is refused. The cycle checks run on :class:`Quotient`, which
makes a 10k-node graph take seconds instead of minutes (``bench/bench_partition.py``).

Differences from torch, on purpose:

* only call nodes (call_function / call_method / call_module) go into partitions, even if the
  operator support accepts placeholders or outputs (fusing those would break the graph);
* ``call_method`` and ``call_module`` nodes count as compute nodes for the single-node rule
  (torch counts only ``call_function`` nodes, so it drops partitions made of modules);
* a ``getitem`` joins the partition of the node it takes an item *of* (its first argument), and
  only when that node's users all take constant items of it (a tuple unpacked). torch moves the
  getitem users of every node whose users are all getitems, until nothing moves: ``Z[:, li, lj]``
  is such a user of ``Z``, ``li`` and ``lj``, which may sit in three partitions, so it moved between
  them forever. Indexing a tensor is an ordinary op, its index tensors ordinary inputs;
* passes that cannot change anything (no new partition, nothing merged since the last pass)
  are skipped; they would be no-ops in torch too.
"""

from __future__ import annotations

import itertools
import operator
from typing import Iterable, Sequence

from torch.fx import GraphModule, Node

from qplug_core.partition.fuse import fuse_by_partitions
from qplug_core.partition.quotient import Quotient
from qplug_core.partition.support import CALLABLE_OPS, OperatorSupportBase, qualified_name

__all__ = ["Partition", "CapabilityBasedPartitioner"]

DEFAULT_NON_COMPUTE_OPS = frozenset({"torch.ops.aten.view", "_operator.getitem"})


def _is_constant_item(node: Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[1], int))


def _takes_item_of_tuple(node: Node) -> bool:
    """``node`` is ``t[k]`` for a constant ``k`` and every user of ``t`` is such an item of it."""
    if not _is_constant_item(node) or not isinstance(node.args[0], Node):
        return False
    producer = node.args[0]
    return all(_is_constant_item(u) and u.args[0] is producer for u in producer.users)


class Partition:
    """A group of nodes fused together; ``nodes`` is an insertion-ordered dict used as a set."""

    def __init__(self, id: int | None = None, nodes: Iterable[Node] | None = None) -> None:
        self.id = id
        self.nodes: dict[Node, None] = dict.fromkeys(nodes or ())

    def __repr__(self) -> str:
        return f"Partition(id={self.id}, nodes={[n.name for n in self.nodes]})"

    def add_node(self, node: Node) -> None:
        self.nodes[node] = None

    def remove_node(self, node: Node) -> None:
        del self.nodes[node]

    def size(self) -> int:
        return len(self.nodes)


class CapabilityBasedPartitioner:
    """Propose and fuse partitions of the nodes ``operator_support`` accepts.

    Single-node partitions are dropped unless ``allows_single_node_partition`` or the node's op
    is in ``allowed_single_node_partition_ops``; partitions whose only compute is in
    ``non_compute_ops`` (plus ``getitem`` and ``aten.view``) are dropped too. Op names are
    qualified names such as ``"torch.ops.aten.add.Tensor"`` or ``"_operator.getitem"``.
    """

    def __init__(self, graph_module: GraphModule, operator_support: OperatorSupportBase,
                 allows_single_node_partition: bool = False,
                 non_compute_ops: Sequence[str] | None = None,
                 allowed_single_node_partition_ops: Sequence[str] | None = None) -> None:
        self.graph_module = graph_module
        self.operator_support = operator_support
        self.allows_single_node_partition = allows_single_node_partition
        self.non_compute_ops = DEFAULT_NON_COMPUTE_OPS | frozenset(non_compute_ops or ())
        self._user_non_compute_ops = frozenset(non_compute_ops or ())
        self.allowed_single_node_partition_ops = frozenset(allowed_single_node_partition_ops or ())

    def _supported(self, nodes: list[Node]) -> list[bool]:
        submodules = dict(self.graph_module.named_modules())
        return [n.op in CALLABLE_OPS and bool(self.operator_support.is_node_supported(submodules, n))
                for n in nodes]

    def propose_partitions(self) -> list[Partition]:
        """Partitions of supported nodes, each acyclic with respect to the others."""
        nodes = list(self.graph_module.graph.nodes)
        supported = self._supported(nodes)
        q = Quotient(nodes, supported)
        live: dict[int, int] = {}  # creation order -> vertex, oldest first
        order_of: dict[int, int] = {}  # vertex -> creation order
        all_bits = 0
        dirty = False
        counter = itertools.count()

        def merge_pass(self_v: int) -> bool:
            merged = False
            for other in self._candidates(q, order_of, self_v, all_bits):
                if other not in order_of:
                    continue
                keep = q.try_merge(self_v, other)
                if keep is None:
                    continue
                merged = True
                first, last = sorted((order_of.pop(self_v), order_of.pop(other)))
                del live[last]
                live[first] = keep
                order_of[keep] = first
                self_v = keep
            return merged

        for i in reversed(range(len(nodes))):
            if supported[i]:
                order = next(counter)
                live[order] = i
                order_of[i] = order
                all_bits |= 1 << i
                merge_pass(i)
                dirty = True
            elif dirty and len(live) > 1:
                dirty = merge_pass(next(iter(live.values())))
        groups = {order: [nodes[m] for m in sorted(q.members[v])] for order, v in live.items()}
        return self._finish(groups)

    @staticmethod
    def _candidates(q: Quotient, order_of: dict[int, int], self_v: int, all_bits: int) -> list[int]:
        """Partitions not separated from ``self_v`` by an unsupported node, oldest first."""
        rest = all_bits & ~q.blocked[self_v] & ~q.bits[self_v]
        found: list[tuple[int, int]] = []
        while rest:
            v = q.vertex_of[(rest & -rest).bit_length() - 1]
            bits = q.bits[v]
            if bits & ~rest == 0:
                found.append((order_of[v], v))
            rest &= ~bits
        found.sort()
        return [v for _, v in found]

    def _finish(self, groups: dict[int, list[Node]]) -> list[Partition]:
        assignment = {n: pid for pid, members in groups.items() for n in members}
        partitions = {pid: Partition(pid, members) for pid, members in groups.items()}
        self._reassign_getitems(partitions, assignment)
        if not self.allows_single_node_partition:
            for pid in [pid for pid, p in partitions.items() if self._compute_count(p) <= 1]:
                del partitions[pid]
        return [p for p in partitions.values() if p.size() > 0]

    def _reassign_getitems(self, partitions: dict[int, Partition],
                           assignment: dict[Node, int]) -> None:
        """Put each item taken of a tuple into the partition of the node making the tuple.

        Each such getitem has one producer, which comes before it in graph order, so one pass in
        that order settles chains of getitems (``t[0][1]``) and ends with the graph. Moving a node
        whose only input is in a partition into that partition cannot make the partitions cyclic.
        """
        for node in self.graph_module.graph.nodes:
            if not _takes_item_of_tuple(node):
                continue
            pid = assignment.get(node.args[0])
            old = assignment.pop(node, None)
            if old is not None:
                partitions[old].remove_node(node)
            if pid is not None:
                assignment[node] = pid
                partitions[pid].add_node(node)

    def _compute_count(self, partition: Partition) -> int:
        count = 0
        for node in partition.nodes:
            if node.op not in CALLABLE_OPS:
                continue
            name = qualified_name(node.target) if node.op == "call_function" else ""
            count += name not in self.non_compute_ops
            count += name in self.allowed_single_node_partition_ops
        return count

    def remove_bookend_non_compute_ops(self, partitions: list[Partition]) -> None:
        """Drop the ``non_compute_ops`` nodes at a partition's edges, in place (as torch does).

        A non-compute node (a view, a transpose named in ``non_compute_ops``) is a bookend when
        all its inputs, or all its users, lead out of the partition through non-compute nodes only;
        moving it out saves the backend a copy without losing any compute.
        """
        ops = self._user_non_compute_ops

        def non_compute(node: Node) -> bool:
            return node.op == "call_function" and qualified_name(node.target) in ops

        for partition in partitions:
            members = set(partition.nodes)
            removed: set[Node] = set()
            memo: dict[tuple[Node, bool], bool] = {}

            def transparent(node: Node, upward: bool) -> bool:
                if node.op == "placeholder" or node not in members or node in removed:
                    return True
                key = (node, upward)
                if key not in memo:
                    memo[key] = non_compute(node) and all(
                        transparent(n, upward)
                        for n in (node.all_input_nodes if upward else node.users))
                return memo[key]

            for node in partition.nodes:
                if non_compute(node) and (transparent(node, True) or transparent(node, False)):
                    removed.add(node)
            for node in removed:
                partition.nodes.pop(node, None)

    def fuse_partitions(self, partitions: list[Partition], prefix: str = "fused_") -> GraphModule:
        """Replace each partition by a ``call_module`` of a new submodule (in place)."""
        return fuse_by_partitions(self.graph_module, [list(p.nodes) for p in partitions],
                                  prefix=prefix)

    def partition_and_fuse(self, prefix: str = "fused_") -> GraphModule:
        """:meth:`propose_partitions` then :meth:`fuse_partitions`."""
        return self.fuse_partitions(self.propose_partitions(), prefix=prefix)
