"""Port of PyTorch's ``test/fx/test_matcher_utils.py`` (TestMatcher).

Translation: ``torch.fx.passes.utils.matcher_utils.SubgraphMatcher`` -> ``qp.matcher.SubgraphMatcher``,
same graphs (symbolic_trace / make_fx), same arguments, same expected match counts.
"""

from __future__ import annotations

import torch
from torch.fx import symbolic_trace
from torch.fx.experimental.proxy_tensor import make_fx

import qplug_core as qp


def test_subgraph_matcher_with_attributes():
    class LargeModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self._weight = torch.nn.Parameter(torch.ones(3, 3))
            self._bias = torch.nn.Parameter(torch.ones(3, 3))

        def forward(self, x):
            return torch.ops.aten.addmm.default(self._bias, x, self._weight)

    large_model_graph = symbolic_trace(LargeModel()).graph

    class PatternModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self._weight_1 = torch.nn.Parameter(torch.ones(5, 5))
            self._bias_1 = torch.nn.Parameter(torch.ones(5, 5))

        def forward(self, x):
            return torch.ops.aten.addmm.default(self._bias_1, x, self._weight_1)

    pattern_graph = torch.fx.symbolic_trace(PatternModel()).graph
    match_result = qp.matcher.SubgraphMatcher(pattern_graph).match(large_model_graph)
    assert len(match_result) == 1


def test_subgraph_matcher_with_list():
    def original(x, y):
        return torch.ops.aten.view(x, [5, y.shape[0]])
    original_graph = torch.fx.symbolic_trace(original).graph

    def pattern(x, y, z):
        return torch.ops.aten.view(x, [z, y.shape[0]])
    pattern_graph = torch.fx.symbolic_trace(pattern).graph

    match_result = qp.matcher.SubgraphMatcher(pattern_graph).match(original_graph)
    assert len(match_result) == 1


def test_subgraph_matcher_with_list_bad():
    def original(x, y):
        return torch.ops.aten._reshape_alias_copy.default(x, [1, y.shape[0]], [y.shape[1], y.shape[1]])
    original_graph = torch.fx.symbolic_trace(original).graph

    def pattern(x, y, b):
        return torch.ops.aten._reshape_alias_copy.default(x, [b, y.shape[0], y.shape[1]], [y.shape[1]])
    pattern_graph = torch.fx.symbolic_trace(pattern).graph

    match_result = qp.matcher.SubgraphMatcher(pattern_graph).match(original_graph)
    assert len(match_result) == 0


def test_subgraph_matcher_ignore_literals():
    def original(x):
        return x + 1

    original_graph = make_fx(original)(torch.ones(3, 3)).graph
    original_graph.eliminate_dead_code()

    def pattern(x):
        return x + 2
    pattern_graph = make_fx(pattern)(torch.ones(4, 4)).graph
    pattern_graph.eliminate_dead_code()

    assert len(qp.matcher.SubgraphMatcher(pattern_graph).match(original_graph)) == 0
    matcher = qp.matcher.SubgraphMatcher(pattern_graph, ignore_literals=True)
    assert len(matcher.match(original_graph)) == 1
