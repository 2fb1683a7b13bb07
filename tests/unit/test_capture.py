"""capture_module / capture_aten: graphs, opaque leaves, module stacks and TraceError hints."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qplug_core.errors import TraceError
from qplug_core.ir import capture_aten, capture_module


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gate = DataDependent()

    def forward(self, x):
        return self.gate(self.lin(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return torch.relu(self.block(x))


def test_untraceable_submodule_is_named_with_both_fixes():
    with pytest.raises(TraceError) as info:
        capture_module(Model())
    err = info.value
    assert err.module == "block.gate"
    msg = str(err)
    assert "non_traceable_module_names=['block.gate']" in msg and "DataDependent" in msg
    assert "qp.eager" in msg
    assert err.__cause__ is not None


def test_top_level_failure_points_at_forward():
    with pytest.raises(TraceError, match="top-level forward of DataDependent"):
        capture_module(DataDependent())


@pytest.mark.parametrize("kwargs", [{"non_traceable_module_names": ["block.gate"]},
                                    {"non_traceable_module_classes": [DataDependent]},
                                    {"leaf_modules": [DataDependent]}])
def test_marked_modules_become_opaque_leaves(kwargs):
    model = Model()
    gm = capture_module(model, **kwargs)
    mods = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert mods == ["block.lin", "block.gate"]
    gate = next(n for n in gm.graph.nodes if n.target == "block.gate")
    assert list(gate.meta["nn_module_stack"]) == ["block", "block.gate"]
    x = torch.randn(2, 3)
    torch.testing.assert_close(gm(x), model(x))


def test_capture_aten_targets_aten_ops():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return torch.relu(self.lin(x))

    m = M()
    x = torch.randn(2, 3)
    gm = capture_aten(m, (x,))
    fns = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.relu.default in fns
    assert any(n.op == "get_attr" and n.target == "lin.weight" for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), m(x))


def test_capture_aten_errors_are_trace_errors():
    with pytest.raises(TraceError, match="torch.export could not capture DataDependent"):
        capture_aten(DataDependent(), (torch.randn(3),))
    with pytest.raises(TraceError, match="tuple"):
        capture_aten(DataDependent(), torch.randn(3))
