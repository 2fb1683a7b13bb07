"""Tests of the single-node predicate ``is_match`` and the graph walk ``find_matches``."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.utils import parametrize

from qplug_core.errors import GraphError, PatternError
from qplug_core.matcher import (
    InternalMatch,
    Match,
    PatternIndex,
    SubgraphMatcher,
    build_match,
    find_matches,
    is_match,
    type_before_parametrizations,
)
from qplug_core.patterns import MatchAllNode

RESNET_TAIL_LEFT = (nn.ReLU, (operator.add, MatchAllNode, (nn.BatchNorm2d, nn.Conv2d)))
RESNET_TAIL_RIGHT = (nn.ReLU, (operator.add, (nn.BatchNorm2d, nn.Conv2d), MatchAllNode))


class LeafTracer(fx.Tracer):
    """Keeps user subclasses of torch.nn modules as call_module nodes, like torch.nn modules."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, (nn.Conv2d, nn.ReLU)) or super().is_leaf_module(m, qualname)


def trace(module: nn.Module) -> tuple[fx.GraphModule, dict[str, fx.Node], dict[str, nn.Module]]:
    gm = fx.GraphModule(module, LeafTracer().trace(module))
    return gm, {n.name: n for n in gm.graph.nodes}, dict(gm.named_modules())


class ResidualBlock(nn.Module):
    """relu(y + bn(conv(y))) with y = relu0(conv0(x)); ``swap`` puts the residual on the right."""

    def __init__(self, swap: bool = False):
        super().__init__()
        self.swap = swap
        self.conv0, self.relu0 = nn.Conv2d(3, 3, 1), nn.ReLU()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU()

    def forward(self, x):
        y = self.relu0(self.conv0(x))
        z = self.bn(self.conv(y))
        return self.relu(z + y if self.swap else y + z)


class ConvReLU(nn.Module):
    def __init__(self, conv: nn.Module | None = None):
        super().__init__()
        self.conv = conv if conv is not None else nn.Conv2d(3, 3, 1)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv(x))


class Unit(nn.Module):
    def forward(self, w):
        return w * 1.0


class MyConv(nn.Conv2d):
    pass


# -- is_match: the predicate -----------------------------------------------------------------------


@pytest.mark.parametrize(("swap", "pattern", "expected"), [
    (False, RESNET_TAIL_LEFT, True), (False, RESNET_TAIL_RIGHT, False),
    (True, RESNET_TAIL_LEFT, False), (True, RESNET_TAIL_RIGHT, True),
])
def test_resnet_tail_matchallnode_position(swap, pattern, expected):
    _, nodes, modules = trace(ResidualBlock(swap))
    assert is_match(modules, nodes["relu"], pattern) is expected


def test_torch_add_and_operator_add_are_different_patterns():
    class M(nn.Module):
        def forward(self, x, y):
            return torch.add(x, y) + y

    _, nodes, modules = trace(M())
    add_function, plus = nodes["add"], nodes["add_1"]
    assert is_match(modules, add_function, (torch.add, MatchAllNode, MatchAllNode))
    assert not is_match(modules, add_function, (operator.add, MatchAllNode, MatchAllNode))
    assert is_match(modules, plus, (operator.add, MatchAllNode, MatchAllNode))
    assert not is_match(modules, plus, (torch.add, MatchAllNode, MatchAllNode))


def test_four_relus_are_four_patterns():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(F.relu(torch.relu(x.relu())))

    _, nodes, modules = trace(M())
    by_kind = {"relu": "relu", "torch.relu": "relu_1", "F.relu": "relu_2", "nn.ReLU": "relu_3"}
    patterns = {"relu": "relu", "torch.relu": torch.relu, "F.relu": F.relu, "nn.ReLU": nn.ReLU}
    for kind, name in by_kind.items():
        hits = {k for k, p in patterns.items() if is_match(modules, nodes[name], p)}
        assert hits == {kind}, (name, hits)


def test_method_pattern_with_args():
    class M(nn.Module):
        def forward(self, x):
            return x.relu().add(1)

    _, nodes, modules = trace(M())
    assert is_match(modules, nodes["add"], ("add", ("relu", MatchAllNode), 1))
    assert not is_match(modules, nodes["add"], ("add", ("relu", MatchAllNode), 2))
    assert not is_match(modules, nodes["add"], ("mul", ("relu", MatchAllNode), 1))


class ShapeIndex(nn.Module):
    def forward(self, x):
        return x.view(x.shape[0], -1) + x.dtype.itemsize * 0


def test_getattr_pattern_compares_attribute_name():
    _, nodes, modules = trace(ShapeIndex())
    shape = next(n for n in nodes.values() if n.target is getattr and n.args[1] == "shape")
    assert is_match(modules, shape, (getattr, "shape"))
    assert not is_match(modules, shape, (getattr, "dtype"))


def test_literal_args_compare_with_equality():
    _, nodes, modules = trace(ShapeIndex())
    item = nodes["getitem"]
    assert is_match(modules, item, (operator.getitem, (getattr, "shape"), 0))
    assert not is_match(modules, item, (operator.getitem, (getattr, "shape"), 1))
    assert is_match(modules, nodes["view"], ("view", MatchAllNode, MatchAllNode, -1))
    assert not is_match(modules, nodes["view"], ("view", MatchAllNode, MatchAllNode, -2))


def test_matchallnode_matches_literals_and_multi_use_nodes():
    _, nodes, modules = trace(ShapeIndex())
    assert is_match(modules, 0, MatchAllNode)
    assert is_match(modules, "anything", MatchAllNode, max_uses=1)
    x = nodes["x"]
    assert len(x.users) > 1
    assert is_match(modules, x, MatchAllNode, max_uses=1)


def test_parametrized_module_matches_its_original_class():
    class Double(nn.Module):
        def forward(self, weight):
            return weight * 2

    conv = nn.Conv2d(3, 3, 1)
    parametrize.register_parametrization(conv, "weight", Double())
    assert type(conv) is not nn.Conv2d
    assert type_before_parametrizations(conv) is nn.Conv2d
    _, nodes, modules = trace(ConvReLU(conv))
    assert is_match(modules, nodes["relu"], (nn.ReLU, nn.Conv2d))


def test_subclass_of_conv2d_does_not_match_conv2d():
    _, nodes, modules = trace(ConvReLU(MyConv(3, 3, 1)))
    assert nodes["conv"].op == "call_module"
    assert not is_match(modules, nodes["relu"], (nn.ReLU, nn.Conv2d))
    assert is_match(modules, nodes["relu"], (nn.ReLU, MyConv))


def test_inner_node_with_two_users_is_not_absorbed():
    class M(ConvReLU):
        def forward(self, x):
            y = self.conv(x)
            return self.relu(y), y

    gm, nodes, modules = trace(M())
    assert not is_match(modules, nodes["relu"], (nn.ReLU, nn.Conv2d))
    assert is_match(modules, nodes["relu"], (nn.ReLU, MatchAllNode))
    assert is_match(modules, nodes["conv"], nn.Conv2d)  # the anchor may have many users
    matches = find_matches(gm, [(nn.ReLU, nn.Conv2d), nn.ReLU, nn.Conv2d])
    assert matches["relu"].pattern is nn.ReLU and matches["conv"].pattern is nn.Conv2d


def test_kwargs_are_ignored_but_positional_arity_must_match():
    class M(nn.Module):
        def forward(self, x):
            return F.relu(x, inplace=False)

    _, nodes, modules = trace(M())
    relu = nodes["relu"]
    assert relu.kwargs == {"inplace": False}
    assert is_match(modules, relu, (F.relu, MatchAllNode))
    assert not is_match(modules, relu, (F.relu, MatchAllNode, MatchAllNode))
    assert is_match(modules, relu, (F.relu,))  # no sub-patterns: arity not checked


def test_missing_module_is_a_graph_error():
    _, nodes, _ = trace(ConvReLU())
    with pytest.raises(GraphError, match="calls module 'conv'.*named_modules") as info:
        is_match({}, nodes["conv"], nn.Conv2d)
    assert info.value.node == "conv"


@pytest.mark.parametrize("pattern", [(), getattr, (getattr, "shape", 0)])
def test_is_match_rejects_malformed_patterns(pattern):
    _, nodes, modules = trace(ShapeIndex())
    with pytest.raises(PatternError):
        is_match(modules, nodes["getitem"], pattern)


# -- Match structure -------------------------------------------------------------------------------


@pytest.mark.parametrize(("swap", "pattern"), [(False, RESNET_TAIL_LEFT),
                                               (True, RESNET_TAIL_RIGHT)])
def test_match_structure_and_root_skip_matchallnode_input(swap, pattern):
    gm, nodes, _ = trace(ResidualBlock(swap))
    match = find_matches(gm, {pattern: "cfg"})["relu"]
    relu, add, bn, conv, y = (nodes[k] for k in ("relu", "add", "bn", "conv", "relu0"))
    inner = (add, y, (bn, conv)) if not swap else (add, (bn, conv), y)
    assert match.node_pattern == (relu, inner)
    assert match.nodes == (relu, add, bn, conv)
    assert match.inputs == (y,)
    assert match.root is conv
    assert match.anchor is relu and match.config == "cfg" and match.pattern is pattern


@pytest.mark.parametrize(("pattern", "root"), [
    (nn.ReLU, "relu"), ((nn.ReLU,), "relu"), ((nn.ReLU, nn.Conv2d), "conv"),
    ((nn.ReLU, MatchAllNode), "relu"),
])
def test_default_root(pattern, root):
    gm, nodes, _ = trace(ConvReLU())
    assert find_matches(gm, [pattern])["relu"].root is nodes[root]


def test_literal_and_getattr_positions_are_not_members_nor_inputs():
    gm, nodes, _ = trace(ShapeIndex())
    match = find_matches(gm, [(operator.getitem, (getattr, "shape"), 0)])["getitem"]
    getitem, shape = nodes["getitem"], nodes["getattr_1"]
    assert shape.args[1] == "shape"
    assert match.node_pattern == (getitem, shape, 0)
    assert match.nodes == (getitem, shape) and match.inputs == ()
    assert match.root is shape


# -- find_matches: the walk ------------------------------------------------------------------------


def test_every_member_maps_to_the_same_match_and_inputs_stay_matchable():
    gm, nodes, _ = trace(ResidualBlock())
    matches = find_matches(gm, [RESNET_TAIL_LEFT, (nn.ReLU, nn.Conv2d)])
    tail = matches["relu"]
    assert all(matches[name] is tail for name in ("relu", "add", "bn", "conv"))
    # relu0 fed the add through MatchAllNode: it is free for its own conv-relu pattern
    assert matches["relu0"].pattern == (nn.ReLU, nn.Conv2d)
    assert matches["conv0"] is matches["relu0"]
    assert set(matches) == {"relu", "add", "bn", "conv", "relu0", "conv0"}


def test_fusion_pattern_beats_single_op_regardless_of_given_order():
    gm, nodes, _ = trace(ConvReLU())
    matches = find_matches(gm, {nn.ReLU: "single", (nn.ReLU, nn.Conv2d): "fused"})
    assert matches["relu"].config == "fused" and matches["conv"] is matches["relu"]


def test_longer_pattern_beats_shorter():
    gm, _, _ = trace(ResidualBlock())
    shorter = (nn.ReLU, (operator.add, MatchAllNode, MatchAllNode))
    matches = find_matches(gm, [shorter, RESNET_TAIL_LEFT])
    assert matches["relu"].pattern is RESNET_TAIL_LEFT


@pytest.mark.parametrize("first", ["conv", "any"])
def test_equal_size_ties_go_to_insertion_order(first):
    gm, _, _ = trace(ConvReLU())
    by_name = {"conv": (nn.ReLU, nn.Conv2d), "any": (nn.ReLU, MatchAllNode)}
    ordered = [by_name[first]] + [p for k, p in by_name.items() if k != first]
    assert find_matches(gm, ordered)["relu"].pattern == by_name[first]


def test_first_match_wins_without_backtracking():
    """relu1(relu0(conv(x))): the walk claims relu1-relu0 first, so conv-relu0 cannot form."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.relu0, self.relu1 = nn.Conv2d(3, 3, 1), nn.ReLU(), nn.ReLU()

        def forward(self, x):
            return self.relu1(self.relu0(self.conv(x)))

    gm, _, _ = trace(M())
    matches = find_matches(gm, [(nn.ReLU, nn.ReLU), (nn.ReLU, nn.Conv2d)])
    assert matches["relu1"].nodes == matches["relu0"].nodes
    assert "conv" not in matches


def test_a_later_pattern_cannot_steal_a_member():
    """In a graph whose node order was edited, conv is visited (and claimed) before relu."""
    gm, nodes, _ = trace(ConvReLU())
    nodes["x"].append(nodes["relu"])  # order now: x, relu, conv, output
    assert [n.name for n in gm.graph.nodes] == ["x", "relu", "conv", "output"]
    matches = find_matches(gm, [(nn.ReLU, nn.Conv2d), nn.Conv2d, nn.ReLU])
    assert matches["conv"].pattern is nn.Conv2d
    assert matches["relu"].pattern is nn.ReLU


def test_patterns_as_iterable_give_none_configs_and_duplicates_collapse():
    gm, _, _ = trace(ConvReLU())
    matches = find_matches(gm, [nn.ReLU, nn.ReLU, nn.Conv2d])
    assert matches["relu"].config is None and isinstance(matches["relu"], Match)


def test_find_matches_validates_patterns():
    gm, _, _ = trace(ConvReLU())
    with pytest.raises(PatternError, match="use the class itself") as info:
        find_matches(gm, [(nn.ReLU, MatchAllNode())])
    assert info.value.position == (1,)


def test_find_matches_uses_given_modules_and_reusable_index():
    gm, _, modules = trace(ConvReLU())
    index = PatternIndex({(nn.ReLU, nn.Conv2d): 1, nn.ReLU: 2})
    assert len(index) == 2
    assert find_matches(gm, index, modules=modules)["conv"].config == 1
    with pytest.raises(GraphError):
        find_matches(gm, index, modules={})


def test_index_offers_a_node_only_patterns_whose_anchor_can_match_it():
    gm, nodes, modules = trace(ResidualBlock())
    patterns = [RESNET_TAIL_LEFT, (nn.ReLU, nn.Conv2d), (F.relu, nn.Linear), nn.Conv2d,
                (operator.add, MatchAllNode, MatchAllNode), ("relu", MatchAllNode), nn.ReLU]
    index = PatternIndex(patterns)
    assert [p for p, _ in index.candidates(nodes["relu"], modules)] == [
        RESNET_TAIL_LEFT, (nn.ReLU, nn.Conv2d), nn.ReLU]
    assert [p for p, _ in index.candidates(nodes["add"], modules)] == [
        (operator.add, MatchAllNode, MatchAllNode)]
    assert index.candidates(nodes["x"], modules) == []


def test_graph_matcher_is_reexported():
    from qplug_core.ir import subgraph_matcher

    assert SubgraphMatcher is subgraph_matcher.SubgraphMatcher
    assert InternalMatch is subgraph_matcher.InternalMatch


def test_build_match_needs_an_operator_anchor():
    _, nodes, _ = trace(ConvReLU())
    assert build_match(nodes["relu"], (nn.ReLU, nn.Conv2d)).root is nodes["conv"]
    with pytest.raises(PatternError, match="anchor is MatchAllNode") as info:
        build_match(nodes["relu"], (MatchAllNode,))
    assert info.value.position == (0,)
