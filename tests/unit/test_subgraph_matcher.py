"""Tests of the pattern-graph matcher on symbolically traced and on exported (ATen) graphs."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from qplug_core.errors import PatternError, TraceError
from qplug_core.ir.subgraph_matcher import (
    InternalMatch,
    SubgraphMatcher,
    aten_graph_of,
    pattern_graph_from,
)

aten = torch.ops.aten


def add_relu(x, y):
    return torch.relu(torch.add(x, y))


def names(nodes) -> list:
    return [n.name if isinstance(n, fx.Node) else n for n in nodes]


def mapping(match: InternalMatch) -> dict[str, object]:
    return {p.name: (g.name if isinstance(g, fx.Node) else g) for p, g in match.nodes_map.items()}


# -- symbolic level --------------------------------------------------------------------------------


def test_finds_every_self_contained_occurrence():
    def model(a, b, c):
        first = torch.relu(torch.add(a, b))
        leaked = torch.add(first, c)
        second = torch.relu(leaked)
        return second, leaked  # `leaked` is used outside its match: rejected

    graph = fx.symbolic_trace(model).graph
    matches = SubgraphMatcher(add_relu).match(graph)
    assert len(matches) == 1
    match = matches[0]
    assert mapping(match) == {"relu": "relu", "add": "add", "x": "a", "y": "b"}
    assert names(match.placeholder_nodes) == ["a", "b"]
    assert names(match.returning_nodes) == ["relu"]
    assert [a.name for a in match.anchors] == ["relu"]


def test_placeholder_is_a_wildcard_that_can_bind_a_literal():
    def model(a):
        return torch.relu(torch.add(a, 2))

    (match,) = SubgraphMatcher(add_relu).match(fx.symbolic_trace(model).graph)
    assert names(match.placeholder_nodes) == ["a", 2]


def test_same_placeholder_must_bind_the_same_value():
    def pattern(x):
        return torch.add(x, x)

    def model(a, b):
        return torch.add(a, a), torch.add(a, b)

    matches = SubgraphMatcher(pattern).match(fx.symbolic_trace(model).graph)
    assert [m.returning_nodes[0].name for m in matches] == ["add"]


def test_literals_are_compared_unless_ignored():
    def pattern(x):
        return torch.add(x, 1)

    graph = fx.symbolic_trace(lambda a: torch.add(a, 2)).graph
    assert SubgraphMatcher(pattern).match(graph) == []
    assert len(SubgraphMatcher(pattern, ignore_literals=True).match(graph)) == 1
    same_value_other_type = fx.symbolic_trace(lambda a: torch.add(a, 1.0)).graph
    assert SubgraphMatcher(pattern).match(same_value_other_type) == []


def test_kwargs_must_have_the_same_keys():
    def pattern(x):
        return torch.sum(x, dim=1)

    assert len(SubgraphMatcher(pattern).match(
        fx.symbolic_trace(lambda a: torch.sum(a, dim=1)).graph)) == 1
    assert SubgraphMatcher(pattern).match(fx.symbolic_trace(lambda a: torch.sum(a, 1)).graph) == []


def test_match_output_requires_the_pattern_to_end_the_graph():
    def tail(a, b):
        return torch.relu(torch.add(a, b))

    def not_tail(a, b):
        return torch.neg(torch.relu(torch.add(a, b)))

    strict = SubgraphMatcher(add_relu, match_output=True)
    assert len(strict.match(fx.symbolic_trace(tail).graph)) == 1
    assert strict.match(fx.symbolic_trace(not_tail).graph) == []
    assert len(SubgraphMatcher(add_relu).match(fx.symbolic_trace(not_tail).graph)) == 1


def test_match_placeholder_requires_graph_inputs():
    def model(a, b):
        return torch.relu(torch.add(torch.neg(a), b))

    graph = fx.symbolic_trace(model).graph
    assert len(SubgraphMatcher(add_relu).match(graph)) == 1
    assert SubgraphMatcher(add_relu, match_placeholder=True).match(graph) == []


def test_overlapping_matches_are_removed_unless_asked():
    def pattern(x):
        return torch.neg(torch.neg(x))

    def model(a):
        return torch.neg(torch.neg(torch.neg(a)))

    graph = fx.symbolic_trace(model).graph
    assert [m.anchors[0].name for m in SubgraphMatcher(pattern).match(graph)] == ["neg_1"]
    kept = SubgraphMatcher(pattern, remove_overlapping_matches=False).match(graph)
    assert [m.returning_nodes[0].name for m in kept] == ["neg_1", "neg_2"]


def test_returned_nodes_may_be_used_outside_but_fusing_must_not_make_a_cycle():
    def pattern(x, y):
        r = torch.relu(x)
        return r, torch.add(r, y)

    def ok(a, b):
        r = torch.relu(a)
        return torch.add(r, b), torch.neg(r)

    def cycle(a):
        r = torch.relu(a)
        return torch.add(r, torch.neg(r))

    (match,) = SubgraphMatcher(pattern).match(fx.symbolic_trace(ok).graph)
    assert names(match.returning_nodes) == ["relu", "add"]
    assert SubgraphMatcher(pattern).match(fx.symbolic_trace(cycle).graph) == []


def test_multi_anchor_pattern_backtracks_over_candidates():
    def pattern(x):
        return torch.relu(x), torch.sigmoid(x)

    def model(a, b):
        return torch.relu(a), torch.sigmoid(b), torch.sigmoid(a)

    (match,) = SubgraphMatcher(pattern).match(fx.symbolic_trace(model).graph)
    assert mapping(match)["relu"] == "relu" and mapping(match)["sigmoid"] == "sigmoid_1"
    assert names(match.placeholder_nodes) == ["a"]


def test_call_module_nodes_compare_qualified_names_like_torch():
    class LinearReLU(torch.nn.Module):
        def __init__(self, name: str):
            super().__init__()
            self.name = name
            setattr(self, name, torch.nn.Linear(2, 2))

        def forward(self, x):
            return torch.relu(getattr(self, self.name)(x))

    pattern = fx.symbolic_trace(LinearReLU("lin"))
    assert len(SubgraphMatcher(pattern).match(fx.symbolic_trace(LinearReLU("lin")))) == 1
    assert SubgraphMatcher(pattern).match(fx.symbolic_trace(LinearReLU("other"))) == []


def test_get_attr_tensors_match_by_kind():
    class WithConst(torch.nn.Module):
        def __init__(self, value: float):
            super().__init__()
            self.register_buffer("c", torch.full((2,), value))

        def forward(self, x):
            return torch.add(x, self.c)

    pattern = fx.symbolic_trace(WithConst(0.0))
    assert len(SubgraphMatcher(pattern).match(fx.symbolic_trace(WithConst(5.0)).graph)) == 1


# -- pattern inputs --------------------------------------------------------------------------------


def test_pattern_may_be_graph_graphmodule_or_callable():
    gm = fx.symbolic_trace(add_relu)
    assert pattern_graph_from(gm.graph) is gm.graph
    assert pattern_graph_from(gm) is gm.graph
    assert [n.op for n in pattern_graph_from(add_relu).nodes] == [
        "placeholder", "placeholder", "call_function", "call_function", "output"]


def test_bad_patterns_raise_project_errors():
    with pytest.raises(PatternError, match="must be an fx.Graph"):
        SubgraphMatcher(42)  # type: ignore[arg-type]
    with pytest.raises(PatternError, match="non-empty"):
        SubgraphMatcher(fx.Graph())

    def dead(x):
        torch.neg(x)
        return torch.relu(x)

    with pytest.raises(PatternError, match="'neg' is dead code"):
        SubgraphMatcher(dead)

    def untraceable(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(TraceError, match="Cannot symbolically trace"):
        SubgraphMatcher(untraceable)


# -- ATen level (torch.export) ---------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, y):
        a = torch.relu(self.l1(x) + y)
        return torch.relu(self.l2(a) + y)


def test_exported_pattern_matches_exported_graph():
    example = (torch.randn(2, 4), torch.randn(2, 4))
    graph = aten_graph_of(Block(), example)
    pattern = aten_graph_of(lambda x, y: torch.relu(x + y), example)
    targets = {n.target for n in pattern.graph.nodes if n.op == "call_function"}
    assert targets == {aten.add.Tensor, aten.relu.default}
    matches = SubgraphMatcher(pattern).match(graph)
    assert len(matches) == 2
    for match in matches:
        assert {n.target for n in match.returning_nodes} == {aten.relu.default}

    linear = aten_graph_of(lambda x, w, b: torch.nn.functional.linear(x, w, b),
                           (torch.randn(2, 4), torch.randn(4, 4), torch.randn(4)))
    assert len(SubgraphMatcher(linear).match(graph)) == 2


def test_aten_args_are_normalized_against_the_schema():
    """add.Tensor(x, y) and add.Tensor(x, y, alpha=1) are the same call once defaults are filled."""
    pattern = fx.Graph()
    x, y = pattern.placeholder("x"), pattern.placeholder("y")
    pattern.output(pattern.call_function(aten.add.Tensor, (x, y)))

    def graph_with(kwargs):
        graph = fx.Graph()
        a, b = graph.placeholder("a"), graph.placeholder("b")
        graph.output(graph.call_function(aten.add.Tensor, (a, b), kwargs))
        return graph

    assert len(SubgraphMatcher(pattern).match(graph_with({"alpha": 1}))) == 1
    assert SubgraphMatcher(pattern).match(graph_with({"alpha": 2})) == []


def test_aten_graph_of_reports_export_failures():
    def data_dependent(x):
        return x[: int(x.sum().item())]

    with pytest.raises(TraceError, match="torch.export could not capture"):
        aten_graph_of(data_dependent, (torch.ones(3),))


# -- agreement with torch's own SubgraphMatcher ----------------------------------------------------


def _models():
    def chain(a, b, c):
        first = torch.relu(torch.add(a, b))
        return torch.relu(torch.add(first, c)), torch.relu(torch.add(c, 1))

    def shared(a, b):
        s = torch.add(a, b)
        return torch.relu(s), torch.relu(torch.add(s, s))

    return [chain, shared]


def _patterns():
    def pair(x):
        return torch.relu(x), torch.add(x, x)

    def add_one(x):
        return torch.add(x, 1)

    return [add_relu, pair, add_one]


@pytest.mark.parametrize("model", _models())
@pytest.mark.parametrize("pattern", _patterns())
@pytest.mark.parametrize("options", [{}, {"remove_overlapping_matches": False},
                                     {"ignore_literals": True}, {"match_placeholder": True}])
def test_agrees_with_torch_subgraph_matcher(model, pattern, options):
    matcher_utils = pytest.importorskip("torch.fx.passes.utils.matcher_utils")
    graph = fx.symbolic_trace(model).graph
    pattern_graph = fx.symbolic_trace(pattern).graph
    expected = matcher_utils.SubgraphMatcher(pattern_graph, **options).match(graph)
    actual = SubgraphMatcher(pattern_graph, **options).match(graph)
    assert [mapping(m) for m in actual] == [mapping(m) for m in expected]
    assert [names(m.placeholder_nodes) for m in actual] == [
        names(m.placeholder_nodes) for m in expected]
