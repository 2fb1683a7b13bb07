"""Graph codec: every kind of fx argument survives the file, and only tensor operations may be called."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from serialization_testkit import bits, round_trip
from torch import fx, nn

from qplug_core.errors import ConfigError
from qplug_core.serialization.graph_codec import decode_graph, encode_graph
from qplug_core.serialization.values import decode_op, encode_op


class Ops(nn.Module):
    """Slices, Ellipsis, methods, getattr, dtypes, devices, memory formats, inf, containers."""

    def forward(self, x, scale: float = 2.0):
        a = x[..., 1:3, None]
        b = x.view(x.size(0), -1).permute(1, 0)
        c = torch.zeros_like(x, dtype=torch.float64, memory_format=torch.contiguous_format)
        d = torch.clamp(x, min=-float("inf"), max=2.5)
        e = x.to(torch.device("cpu"), non_blocking=False)
        f = torch.cat([a, a], dim=-1)
        g = F.pad(x, (1, 1), mode="constant", value=0.0)
        total = a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + f.sum() + g.sum() + x.shape[0] * scale
        return {"total": total, "parts": (f, [g])}


def test_graph_arguments_round_trip(tmp_path):
    gm = fx.symbolic_trace(Ops())
    loaded = round_trip(gm, tmp_path)
    x = torch.randn(2, 3, 4)

    assert loaded.code == gm.code
    expected, actual = gm(x), loaded(x)
    assert torch.equal(bits(actual["total"]), bits(expected["total"]))
    assert torch.equal(actual["parts"][1][0], expected["parts"][1][0])
    assert torch.equal(bits(loaded(x, 3.0)["total"]), bits(gm(x, 3.0)["total"]))


def test_nodes_keep_their_qplug_tags():
    gm = fx.symbolic_trace(Ops())
    for node in gm.graph.nodes:
        node.meta.update({"qplug_value": "float_tensor", "qplug_boundary": True, "stack_trace": "dropped"})
    decoded = decode_graph(encode_graph(gm.graph))

    kept = {"qplug_value": "float_tensor", "qplug_boundary": True}
    assert [n.meta for n in decoded.nodes] == [kept] * len(gm.graph.nodes)


@pytest.mark.parametrize("fn", [operator.add, operator.getitem, getattr, torch.flatten, torch.cat, F.relu,
                                F.linear, torch.split, torch.nn.functional.interpolate,
                                torch.ops.aten.add.Tensor])
def test_tensor_operations_may_be_called(fn):
    assert decode_op(encode_op(fn, "graph"), "graph") is fn


@pytest.mark.parametrize("fn", [torch.load, torch.save, torch.from_file, torch.set_num_threads,
                                torch.set_default_dtype, torch.compile, operator.attrgetter,
                                operator.methodcaller, torch.nn.Linear, torch.ops.aten.from_file.default])
def test_functions_with_side_effects_may_not_be_called(fn):
    with pytest.raises(ConfigError, match="not in qplug's table"):
        encode_op(fn, "graph")
