"""Built-in passes on small real models, at module level (symbolic trace) and ATen level (export)."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from qplug_core.ir import capture_aten, capture_module
from qplug_core.passes import (
    ConstantFoldingPass,
    DecomposePass,
    PassManager,
    RemoveNoOpsPass,
    ReplaceOpPass,
    ScalarToTensorPass,
    dead_code_elimination,
)

aten = torch.ops.aten


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))
        self.drop = nn.Dropout(0.5)
        self.ident = nn.Identity()

    def forward(self, x, y):
        h = self.lin(x) + y
        h = torch.relu(h).detach()
        h = self.ident(self.drop(h))
        h = F.dropout(h, 0.3, False)
        return h @ (self.w.t() * 2) + 1


X = (torch.randn(3, 4), torch.randn(3, 4))


@pytest.fixture(scope="module")
def model() -> Net:
    torch.manual_seed(0)
    return Net().eval()


@pytest.fixture(scope="module")
def aten_gm(model) -> fx.GraphModule:
    return capture_aten(model, X)


@pytest.fixture
def levels(model, aten_gm) -> dict[str, fx.GraphModule]:
    return {"module": capture_module(model), "aten": aten_gm}


def calls(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


ADD = {"module": operator.add, "aten": aten.add.Tensor}
MUL = {"module": operator.mul, "aten": aten.mul.Tensor}
RELU = {"module": torch.relu, "aten": aten.relu.default}


@pytest.mark.parametrize("level", ["module", "aten"])
def test_replace_op_one_to_one(levels, level):
    gm = levels[level]
    x, y = torch.randn(3, 4), torch.full((3, 4), 2.0)
    add_node = next(n for n in gm.graph.nodes if n.target is ADD[level])
    add_node.meta["qplug_tag"] = "kept"
    out = ReplaceOpPass({ADD[level]: MUL[level]})(gm)
    assert out.modified and ADD[level] not in calls(out.graph_module)
    new = next(n for n in out.graph_module.graph.nodes if n.target is MUL[level]
               and n.args[0].target in ("lin", aten.linear.default))
    assert new.meta["qplug_tag"] == "kept"  # Transformer alone would drop custom keys
    assert new.meta.get("val") is add_node.meta.get("val")
    ref = gm(x, y)
    # add -> mul changes the function: compare with the model evaluated with mul by hand.
    assert not torch.allclose(out.graph_module(x, y), ref)
    assert not ReplaceOpPass({torch.sigmoid: torch.tanh})(gm).modified


@pytest.mark.parametrize("level", ["module", "aten"])
def test_decompose_relu_keeps_outputs_and_meta(levels, level):
    gm = levels[level]
    relu = next(n for n in gm.graph.nodes if n.target is RELU[level])
    relu.meta["qplug_tag"] = "relu"
    decomp = {"module": lambda x: x * (x > 0),
              "aten": lambda x: aten.mul.Tensor(x, aten.gt.Scalar(x, 0))}[level]
    out = DecomposePass({RELU[level]: decomp})(gm)
    assert out.modified and RELU[level] not in calls(out.graph_module)
    torch.testing.assert_close(out.graph_module(*X), gm(*X))
    tagged = [n for n in out.graph_module.graph.nodes if n.meta.get("qplug_tag") == "relu"]
    # only the node standing for relu's value gets all of its meta (shape included) ...
    assert [n.target for n in tagged] == [MUL[level]]
    assert tagged[0].meta.get("val") is relu.meta.get("val")
    # ... the intermediate comparison gets provenance keys only
    gt = tagged[0].args[1]
    assert "qplug_tag" not in gt.meta
    assert gt.meta.get("nn_module_stack") == relu.meta.get("nn_module_stack")


@pytest.mark.parametrize("level", ["module", "aten"])
def test_remove_noops(levels, level):
    gm = copy.deepcopy(levels[level])  # the aten graph is shared by the module's tests
    expected = gm(*X)
    out = RemoveNoOpsPass()(gm)
    g = out.graph_module
    assert out.modified and g is gm  # in place
    assert not any(n.target in ("detach", torch.detach, aten.detach.default, F.dropout,
                                aten.dropout.default) for n in g.graph.nodes)
    assert not any(n.op == "call_module" and n.target in ("drop", "ident") for n in g.graph.nodes)
    torch.testing.assert_close(g(*X), expected)


def test_training_dropout_is_kept():
    gm = fx.symbolic_trace(nn.Sequential(nn.Dropout(0.5)).train())
    assert not RemoveNoOpsPass()(gm).modified


def test_scalar_to_tensor_on_aten(aten_gm):
    out = ScalarToTensorPass()(aten_gm)
    g = out.graph_module
    assert out.modified
    for n in g.graph.nodes:
        if n.target is aten.add.Tensor:
            assert all(isinstance(a, fx.Node) for a in n.args)
    torch.testing.assert_close(g(*X), aten_gm(*X))


def test_scalar_to_tensor_ignores_non_aten(levels):
    assert not ScalarToTensorPass()(levels["module"]).modified


@pytest.mark.parametrize("level", ["module", "aten"])
def test_constant_folding_folds_weight_transform_only(levels, level):
    gm = levels[level]
    ref = gm(*X)
    out = ConstantFoldingPass()(gm)
    g = out.graph_module
    assert out.modified
    folded = [n for n in g.graph.nodes if n.op == "get_attr" and n.target.startswith("_folded_")]
    assert len(folded) == 1
    value = getattr(g, folded[0].target)
    torch.testing.assert_close(value, gm.get_parameter("w").t() * 2)
    assert not any(n.target in ("t", aten.t.default, aten.permute.default) for n in g.graph.nodes)
    torch.testing.assert_close(g(*X), ref)
    # nothing that depends on an input was folded, so new inputs still give the model's result
    x2 = (torch.randn(3, 4), torch.randn(3, 4))
    torch.testing.assert_close(g(*x2), levels[level](*x2) if level == "module" else gm(*x2))


def test_constant_folding_never_folds_random():
    class R(nn.Module):
        def forward(self, x):
            return x + torch.randn(3)

    assert not ConstantFoldingPass()(fx.symbolic_trace(R())).modified


@pytest.mark.parametrize("level", ["module", "aten"])
def test_dead_code_elimination(levels, level):
    gm = levels[level]
    first = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(first):
        gm.graph.call_function(torch.neg if level == "module" else aten.neg.default, (first,))
    gm.recompile()
    n_before = len(gm.graph.nodes)
    out = dead_code_elimination(gm)
    assert out.modified and len(out.graph_module.graph.nodes) == n_before - 1
    assert not dead_code_elimination(out.graph_module).modified


@pytest.mark.parametrize("level", ["module", "aten"])
def test_pipeline_in_pass_manager(levels, level):
    gm = levels[level]
    passes = [RemoveNoOpsPass(), ConstantFoldingPass(), dead_code_elimination]
    if level == "aten":
        passes.append(ScalarToTensorPass())
    out = PassManager(passes, steps=3, run_checks_after_each_pass=True)(gm)
    torch.testing.assert_close(out.graph_module(*X), gm(*X))
