"""The direct forward of a GraphModule that only calls one submodule (qplug_core.partition.sole):
it answers like the generated code whatever the user does to the module afterwards."""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
from torch import fx, nn

from qplug_core.partition.sole import install, sole_call


class Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x, y):
        return x * self.factor + y


class Top(nn.Module):
    def __init__(self):
        super().__init__()
        self.delegate_0 = Scale(2.0)

    def forward(self, x, y):
        return self.delegate_0(x, y)


class _Leaves(fx.Tracer):
    """Keeps Scale a call_module, as a compiled partition is."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Scale) or super().is_leaf_module(m, qualname)


def _trace(model: nn.Module) -> fx.GraphModule:
    return fx.GraphModule(model, _Leaves().trace(model))


def _model() -> fx.GraphModule:
    gm = _trace(Top())
    assert install(gm)
    return gm


X, Y = torch.ones(2, 3), torch.full((2, 3), 0.5)


def test_it_calls_the_submodule_and_keeps_the_signature():
    gm = _model()
    torch.testing.assert_close(gm(X, Y), X * 2.0 + Y)
    assert list(inspect.signature(gm.forward).parameters) == ["x", "y"]


def test_hooks_on_the_submodule_and_global_hooks_still_run():
    gm = _model()
    handle = gm.delegate_0.register_forward_hook(lambda module, args, out: out + 100.0)
    torch.testing.assert_close(gm(X, Y), X * 2.0 + Y + 100.0)
    handle.remove()
    seen = []
    handle = nn.modules.module.register_module_forward_pre_hook(lambda module, args: seen.append(type(module)))
    try:
        gm(X, Y)
    finally:
        handle.remove()
    assert Scale in seen
    torch.testing.assert_close(gm(X, Y), X * 2.0 + Y)


def test_a_replaced_submodule_or_an_edited_graph_is_what_runs():
    gm = _model()
    gm.delegate_0 = Scale(3.0)
    torch.testing.assert_close(gm(X, Y), X * 3.0 + Y)
    call = next(n for n in gm.graph.nodes if n.op == "call_module")
    with gm.graph.inserting_after(call):
        negated = gm.graph.call_function(torch.neg, (call,))
    call.replace_all_uses_with(negated, delete_user_cb=lambda user: user is not negated)
    gm.recompile()
    torch.testing.assert_close(gm(X, Y), -(X * 3.0 + Y))


def test_copies_and_pickles_answer_alike():
    gm = _model()
    clone = copy.deepcopy(gm)
    clone.delegate_0.factor = 5.0
    torch.testing.assert_close(clone(X, Y), X * 5.0 + Y)
    torch.testing.assert_close(gm(X, Y), X * 2.0 + Y)  # the copy did not change the original
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=False)(X, Y), X * 2.0 + Y)


class TwoCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Scale(2.0), Scale(3.0)

    def forward(self, x, y):
        return self.b(self.a(x, y), y)


class Swapped(Top):
    def forward(self, x, y):
        return self.delegate_0(y, x)


class Default(Top):
    def forward(self, x, y=None):
        return self.delegate_0(x, x)


@pytest.mark.parametrize("model", [TwoCalls(), Swapped(), Default()], ids=["two calls", "args swapped", "unused input"])
def test_other_graphs_keep_the_generated_code(model):
    gm = _trace(model)
    assert sole_call(gm) is None
    assert not install(gm)
    assert "forward" not in gm.__dict__
