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


def _refusing_dynamic_shapes(monkeypatch, static_error: Exception | None = None) -> None:
    """torch.export failing on dynamic shapes (as it does on some models), and optionally on the
    example's fixed shapes too."""
    from qplug_core.ir import capture as ir_capture

    export = ir_capture._export

    def refusing(model, inputs, dynamic):
        if dynamic is not None:
            raise RuntimeError("Constraints violated (dim0)")
        if static_error is not None:
            raise static_error
        return export(model, inputs, dynamic)

    monkeypatch.setattr(ir_capture, "_export", refusing)


def test_export_that_gives_up_dynamic_shapes_says_so(monkeypatch):
    import qplug_core as qp

    _refusing_dynamic_shapes(monkeypatch)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    with pytest.warns(UserWarning, match=r"torch.export could not keep the input sizes dynamic \(RuntimeError: "
                                         r"Constraints violated \(dim0\)\); the captured model takes inputs of "
                                         "the example's shapes only"):
        qp.fuse_fx(model, (torch.randn(3, 4),), backend="reference", capture="export")


def test_export_failing_both_ways_keeps_the_dynamic_error_in_the_chain(monkeypatch):
    import qplug_core as qp

    _refusing_dynamic_shapes(monkeypatch, static_error=ValueError("static says no"))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    with pytest.raises(TraceError, match="ValueError: static says no") as raised:
        qp.fuse_fx(model, (torch.randn(3, 4),), backend="reference", capture="export")
    static = raised.value.__cause__
    assert isinstance(static, ValueError) and "Constraints violated" in str(static.__cause__)
