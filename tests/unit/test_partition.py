"""CapabilityBasedPartitioner and operator support rules."""

from __future__ import annotations

import operator
import threading

import pytest
import torch
from torch import fx, nn

from qplug_core.errors import GraphError
from qplug_core.ir import capture_aten
from qplug_core.partition import (
    CapabilityBasedPartitioner,
    OperatorSupport,
    OperatorSupportBase,
    OpSupports,
    any_chain,
    chain,
)

aten = torch.ops.aten


class AddMul(OperatorSupportBase):
    """The seed's example support."""

    def is_node_supported(self, submodules, node):
        return node.op == "call_function" and node.target in (aten.add.Tensor, aten.mul.Tensor)


class AddMulModel(nn.Module):
    def forward(self, x, y):
        a = x + y
        b = a * y
        c = torch.relu(b)
        return c * x + y


EX = (torch.randn(4), torch.randn(4))


@pytest.fixture(scope="module")
def aten_gm() -> fx.GraphModule:
    return capture_aten(AddMulModel(), EX)


def names(partitions) -> list[set[str]]:
    return sorted(({n.name for n in p.nodes} for p in partitions), key=sorted)


def test_seed_add_mul_example(aten_gm):
    import copy
    gm = copy.deepcopy(aten_gm)
    ref = gm(*EX)
    part = CapabilityBasedPartitioner(gm, AddMul())
    partitions = part.propose_partitions()
    assert names(partitions) == [{"add", "mul"}, {"add_1", "mul_1"}]
    fused = part.fuse_partitions(partitions)
    assert sorted(n.target for n in fused.graph.nodes if n.op == "call_module"
                  and n.target.startswith("fused_")) == ["fused_0", "fused_1"]
    torch.testing.assert_close(fused(*EX), ref)


def diamond() -> fx.GraphModule:
    """a -> (b unsupported) -> d and a -> d: fusing {a, d} would be a cycle through b."""
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.add, (x, x))
    a2 = g.call_function(torch.mul, (a, a))
    b = g.call_function(torch.sigmoid, (a2,))
    d = g.call_function(torch.add, (a2, b))
    d2 = g.call_function(torch.mul, (d, d))
    g.output(d2)
    return fx.GraphModule(nn.Module(), g)


SUPPORT = OperatorSupport({torch.add: None, torch.mul: None})


def test_diamond_refuses_cyclic_merge():
    gm = diamond()
    x = torch.randn(5)
    ref = gm(x)
    part = CapabilityBasedPartitioner(gm, SUPPORT)
    partitions = part.propose_partitions()
    assert names(partitions) == [{"add", "mul"}, {"add_1", "mul_1"}]
    fused = part.fuse_partitions(partitions)
    fused.graph.lint()
    torch.testing.assert_close(fused(x), ref)


def test_independent_partitions_merge_horizontally():
    g = fx.Graph()
    x = g.placeholder("x")
    left = g.call_function(torch.mul, (g.call_function(torch.add, (x, x)), x))
    right = g.call_function(torch.mul, (g.call_function(torch.add, (x, 1.0)), x))
    g.output(g.call_function(torch.sigmoid, (g.call_function(torch.sub, (left, right)),)))
    gm = fx.GraphModule(nn.Module(), g)
    (only,) = CapabilityBasedPartitioner(gm, SUPPORT).propose_partitions()
    assert only.size() == 4
    x_val = torch.randn(3)
    ref = gm(x_val)
    torch.testing.assert_close(CapabilityBasedPartitioner(gm, SUPPORT).partition_and_fuse()(x_val), ref)


def single_add() -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: torch.sigmoid(torch.add(x, x)))


def test_single_node_partitions_dropped_by_default():
    assert CapabilityBasedPartitioner(single_add(), SUPPORT).propose_partitions() == []


def test_single_node_partitions_when_allowed():
    gm = single_add()
    assert len(CapabilityBasedPartitioner(gm, SUPPORT, allows_single_node_partition=True)
               .propose_partitions()) == 1
    assert len(CapabilityBasedPartitioner(gm, SUPPORT, allowed_single_node_partition_ops=[
        "torch.add"]).propose_partitions()) == 1


def test_non_compute_only_partitions_dropped():
    gm = fx.symbolic_trace(lambda x: torch.sigmoid(torch.flatten(torch.add(x, x))))
    support = OperatorSupport({torch.add: None, torch.flatten: None})
    keep = CapabilityBasedPartitioner(gm, support).propose_partitions()
    assert len(keep) == 1 and keep[0].size() == 2
    # flatten counted as non-compute: one compute node left, so the partition is dropped
    assert CapabilityBasedPartitioner(gm, support, non_compute_ops=["torch.flatten"]
                                      ).propose_partitions() == []


def test_getitem_joins_its_producer():
    def f(x):
        parts = torch.split(x * 2, 2)
        return torch.sigmoid(torch.add(parts[0], parts[1]))

    gm = fx.symbolic_trace(f)
    support = OperatorSupport({operator.mul: None, torch.split: None})
    (p,) = CapabilityBasedPartitioner(gm, support).propose_partitions()
    assert {n.name for n in p.nodes} == {"mul", "split", "getitem", "getitem_1"}


def test_modules_count_as_compute():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Sigmoid()))
    support = OperatorSupport({nn.Linear: None, nn.ReLU: None})
    (p,) = CapabilityBasedPartitioner(gm, support).propose_partitions()
    assert {n.target for n in p.nodes} == {"0", "1"}
    x = torch.randn(2, 3)
    ref = gm(x)
    torch.testing.assert_close(CapabilityBasedPartitioner(gm, support).partition_and_fuse()(x), ref)


def test_dtype_rules_on_aten_graph():
    class M(nn.Module):
        def forward(self, x, i):
            return (x + x) * x + (i + i) * i

    gm = capture_aten(M(), (torch.randn(3), torch.arange(3)))
    float_only = OperatorSupport({
        aten.add.Tensor: (([torch.float32], [torch.float32]), {}),
        "torch.ops.aten.mul.Tensor": (([torch.float32],), {}),
    })
    partitions = CapabilityBasedPartitioner(gm, float_only).propose_partitions()
    (p,) = partitions
    assert all(n.meta["val"].dtype == torch.float32 for n in p.nodes)
    no_int = chain(OperatorSupport({aten.add.Tensor: None, aten.mul.Tensor: None}),
                   OpSupports.decline_if_input_dtype(torch.int64))
    assert names(CapabilityBasedPartitioner(gm, no_int).propose_partitions()) == names(partitions)


def test_chain_and_any_chain_and_names():
    gm = diamond()
    nodes = {n.name: n for n in gm.graph.nodes}
    add_only = OperatorSupport({torch.add: None})
    not_add = OpSupports.decline_if_node_in_names({"add"})
    assert not chain(add_only, not_add).is_node_supported({}, nodes["add"])
    assert chain(add_only, not_add).is_node_supported({}, nodes["add_1"])
    assert any_chain(add_only, OperatorSupport({torch.sigmoid: None})).is_node_supported(
        {}, nodes["sigmoid"])
    assert not any_chain(add_only).is_node_supported({}, nodes["mul"])


def test_dtype_rule_without_metadata_is_graph_error():
    gm = diamond()
    support = OperatorSupport({torch.add: (([torch.float32],), {})})
    with pytest.raises(GraphError, match="no dtype metadata"):
        CapabilityBasedPartitioner(gm, support).propose_partitions()


class DotInteraction(nn.Module):
    """DLRM's pairwise interaction: the lower triangle of ``T @ T^T``, taken with index tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.bot, self.top = nn.Linear(8, 16), nn.Linear(6, 1)

    def forward(self, x):
        t = self.bot(x).view(-1, 4, 4)
        z = torch.bmm(t, t.transpose(1, 2))
        li, lj = torch.tril_indices(4, 4, offset=-1)
        return self.top(z[:, li, lj])


def test_indexing_a_tensor_with_index_tensors_is_partitioned_and_returns():
    """``z[:, li, lj]`` is a getitem user of ``z`` and of both index constants (outside any
    partition): it was moved between their partitions forever. Run with a hard timeout."""
    gm = fx.symbolic_trace(DotInteraction())
    support = OperatorSupport({nn.Linear: None, torch.bmm: None, operator.getitem: None, "transpose": None})
    found: list = []
    worker = threading.Thread(target=lambda: found.append(
        CapabilityBasedPartitioner(gm, support).propose_partitions()), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "propose_partitions did not return within 10 s"
    assert names(found[0]) == [{"transpose", "bmm", "getitem", "top"}]


class ReadsAttributes(nn.Module):
    """A class token and position table read by the fused ops; a scale also read outside them."""

    def __init__(self):
        super().__init__()
        self.cls, self.pos = nn.Parameter(torch.randn(1, 4)), nn.Parameter(torch.randn(3, 4))
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        y = torch.cat([self.cls, x], 0) + self.pos
        return torch.relu(y * self.scale) - self.scale


def test_attributes_inside_makes_read_attributes_constants_of_the_submodule_not_inputs():
    from qplug_core.partition import fuse_by_partitions

    gm = fx.symbolic_trace(ReadsAttributes())
    x = torch.randn(2, 4)
    expected = gm(x)
    fused_ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.sub]
    fuse_by_partitions(gm, [fused_ops], attributes_inside=True)
    (call,) = gm.graph.find_nodes(op="call_module", target="fused_0")
    assert [a.name for a in call.args] == ["x"]  # not cls, pos or scale: read inside
    sub = gm.get_submodule("fused_0")
    assert [n.name for n in sub.graph.find_nodes(op="placeholder")] == ["x"]
    assert sub.cls is gm.cls and sub.scale is gm.scale  # shared, not copied
    assert {n.target for n in gm.graph.find_nodes(op="get_attr")} == {"scale"}  # still read by the subtraction
    assert torch.equal(gm(x), expected)


def test_attributes_are_inputs_of_a_fused_submodule_by_default_as_in_torch_fx():
    from qplug_core.partition import fuse_by_partitions

    gm = fx.symbolic_trace(ReadsAttributes())
    fuse_by_partitions(gm, [[n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.sub]])
    (call,) = gm.graph.find_nodes(op="call_module", target="fused_0")
    assert sorted(a.name for a in call.args) == ["cls", "pos", "scale", "x"]


def test_an_attribute_sliced_to_an_input_size_stays_an_input():
    """A position-id table cut to the sequence length, as Hugging Face embeddings do: as a constant
    it would bound that size from above, and the exporter would fix it."""
    from qplug_core.partition import fuse_by_partitions

    root = nn.Module()
    root.register_buffer("ids", torch.arange(8).unsqueeze(0))
    graph = fx.Graph()
    x, ids = graph.placeholder("x"), graph.get_attr("ids")
    length = graph.call_function(operator.getitem, (graph.call_function(getattr, (x, "shape")), 1))
    sliced = graph.call_function(operator.getitem, (ids, (slice(None), slice(None, length))))
    graph.output(graph.call_function(operator.add, (x, sliced)))
    gm = fx.GraphModule(root, graph)
    fuse_by_partitions(gm, [[n for n in gm.graph.nodes if n.op == "call_function"]], attributes_inside=True)
    (call,) = gm.graph.find_nodes(op="call_module", target="fused_0")
    assert [a.name for a in call.args] == ["x", "ids"]
    assert torch.equal(gm(torch.zeros(1, 5)), torch.arange(5.0).unsqueeze(0))
