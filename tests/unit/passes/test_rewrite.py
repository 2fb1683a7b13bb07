"""replace_pattern: many-to-one rewriting on module-level and ATen graphs."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn

from qplug_core.errors import GraphError
from qplug_core.ir import capture_aten
from qplug_core.ir.subgraph_matcher import aten_graph_of
from qplug_core.passes import replace_pattern

aten = torch.ops.aten


def f(x, y):
    a = (x + y) * y
    b = (a + y) * y  # overlaps nothing: reads the first match's result
    return torch.relu(b)


def pattern(x, y):
    return (x + y) * y


def replacement(x, y):
    return x - y


def test_replaces_every_match_in_place():
    gm = fx.symbolic_trace(f)
    x, y = torch.randn(4), torch.randn(4)
    results = replace_pattern(gm, pattern, replacement)
    assert len(results) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [operator.sub, operator.sub, torch.relu]
    torch.testing.assert_close(gm(x, y), torch.relu((x - y) - y))
    second = results[1]
    assert second.replacements and all(r.graph is gm.graph for r in second.replacements)
    assert all(n.graph is gm.graph for n in second.nodes_map.values())  # re-pointed inputs


def test_match_filters_reject():
    gm = fx.symbolic_trace(f)
    assert replace_pattern(gm, pattern, replacement, match_filters=[lambda m, g, p: False]) == []


def test_aten_level_with_exported_pattern():
    class M(nn.Module):
        def forward(self, x, y):
            return torch.relu((x + y) * y)

    ex = (torch.randn(3), torch.randn(3))
    gm = capture_aten(M(), ex)
    pat = aten_graph_of(lambda x, y: aten.mul.Tensor(aten.add.Tensor(x, y), y), ex)
    rep = aten_graph_of(lambda x, y: aten.sub.Tensor(x, y), ex)
    assert len(replace_pattern(gm, pat, rep)) == 1
    torch.testing.assert_close(gm(*ex), torch.relu(ex[0] - ex[1]))


def test_replacement_attributes_are_copied():
    class Rep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(3.0))

        def forward(self, x, y):
            return x * self.scale

    gm = fx.symbolic_trace(f)
    replace_pattern(gm, pattern, fx.symbolic_trace(Rep()))
    x, y = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(gm(x, y), torch.relu(x * 9.0))


def test_arity_mismatch_is_graph_error():
    gm = fx.symbolic_trace(f)
    with pytest.raises(GraphError, match="inputs"):
        replace_pattern(gm, pattern, lambda x: x)
