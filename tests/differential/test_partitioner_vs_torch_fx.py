"""Our CapabilityBasedPartitioner proposes the same partitions as torch.fx's on random DAGs.

Graphs: random DAGs of add/mul/sub/relu/sigmoid (no getitem) with a random supported op set.
Known, tested difference: none expected on these graphs (our documented differences concern
placeholders and module/method counting, which these graphs do not contain).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import fx

from qplug_core.partition import CapabilityBasedPartitioner, OperatorSupportBase

torch_partitioner = pytest.importorskip("torch.fx.passes.infra.partitioner")
torch_support = pytest.importorskip("torch.fx.passes.operator_support")

BINARY = (torch.add, torch.mul, torch.sub)
UNARY = (torch.relu, torch.sigmoid)


def random_graph(rng: random.Random, n_ops: int) -> fx.GraphModule:
    graph = fx.Graph()
    values = [graph.placeholder(f"x{i}") for i in range(rng.randint(1, 3))]
    for _ in range(n_ops):
        # Prefer recent values so that graphs are deep, not just wide.
        pick = lambda: values[max(0, len(values) - 1 - int(rng.expovariate(0.4)))]  # noqa: E731
        if rng.random() < 0.6:
            values.append(graph.call_function(rng.choice(BINARY), (pick(), pick())))
        else:
            values.append(graph.call_function(rng.choice(UNARY), (pick(),)))
    sinks = [v for v in values if not v.users and v.op != "placeholder"] or values[-1:]
    graph.output(tuple(sinks))
    return fx.GraphModule(torch.nn.Module(), graph)


def _supported(node: fx.Node, ops: frozenset) -> bool:
    return node.op == "call_function" and node.target in ops


class Ours(OperatorSupportBase):
    def __init__(self, ops: frozenset) -> None:
        self.ops = ops

    def is_node_supported(self, submodules, node):
        return _supported(node, self.ops)


class Theirs(torch_support.OperatorSupportBase):
    def __init__(self, ops: frozenset) -> None:
        self.ops = ops

    def is_node_supported(self, submodules, node):
        return _supported(node, self.ops)


def node_sets(partitions) -> set[frozenset[str]]:
    return {frozenset(n.name for n in p.nodes) for p in partitions}


def is_acyclic_after_fusion(gm: fx.GraphModule, partitions) -> bool:
    """Contract each partition and check the quotient graph has no cycle."""
    group = {n: i for i, p in enumerate(partitions) for n in p.nodes}
    key = lambda n: ("p", group[n]) if n in group else ("n", n.name)  # noqa: E731
    edges: dict = {}
    for n in gm.graph.nodes:
        for u in n.users:
            if key(n) != key(u):
                edges.setdefault(key(n), set()).add(key(u))
    state: dict = {}

    def visit(v) -> bool:
        state[v] = 1
        for w in edges.get(v, ()):
            if state.get(w) == 1 or (w not in state and not visit(w)):
                return False
        state[v] = 2
        return True

    return all(visit(v) for v in list(edges) if v not in state)


CASES = [(seed, allow_single) for seed in range(220) for allow_single in (False,)] + \
        [(seed, True) for seed in range(1000, 1060)]


@pytest.mark.parametrize("seed,allow_single", CASES)
def test_same_partitions_as_torch(seed: int, allow_single: bool) -> None:
    rng = random.Random(seed)
    gm = random_graph(rng, rng.randint(3, 40))
    ops = frozenset(rng.sample(BINARY + UNARY, rng.randint(1, 4)))
    ours = CapabilityBasedPartitioner(gm, Ours(ops), allows_single_node_partition=allow_single)
    theirs = torch_partitioner.CapabilityBasedPartitioner(
        gm, Theirs(ops), allows_single_node_partition=allow_single)
    our_parts = ours.propose_partitions()
    their_parts = theirs.propose_partitions()
    assert is_acyclic_after_fusion(gm, our_parts)
    if is_acyclic_after_fusion(gm, their_parts):
        assert node_sets(our_parts) == node_sets(their_parts)
