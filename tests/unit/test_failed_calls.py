"""``ir/failed_calls.py``: a GraphModule's failing call raises what ``explain`` gives instead, from
the error and without torch.fx's printout of generated code; other failures, other modules and
successful calls are untouched, and the wrapper survives recompile(), deferred code and deep copies.

No test lets torch.fx print its generated code: that printout imports torch._dynamo (~10 s)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

from qplug_core.ir.deferred_code import graph_module_without_code
from qplug_core.ir.failed_calls import explain_failures

BANNER = "Call using an FX-traced Module"


def _no_text(x):
    """A leaf of the graph: its TypeError is raised in its own frame (torch.fx prints nothing)."""
    if isinstance(x, str):
        raise TypeError("text is no tensor")
    return x


fx.wrap("_no_text")


class _Rows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _no_text(x)[:, 0] + 1  # a rank-1 x: an IndexError in the generated code


def _explain(gm, args, kwargs, error):
    """Explains IndexErrors (a rank-1 input) only."""
    if isinstance(error, IndexError):
        return ValueError(f"x has rank {args[0].dim()}")
    return None


def _explained(gm: fx.GraphModule) -> fx.GraphModule:
    explain_failures(gm, _explain)
    return gm


@pytest.mark.parametrize("make", [
    lambda: _explained(fx.symbolic_trace(_Rows())),
    lambda: copy.deepcopy(_explained(fx.symbolic_trace(_Rows()))),
    lambda: _explained(graph_module_without_code(_Rows(), fx.symbolic_trace(_Rows()).graph, "Rows")),
], ids=["traced", "deep-copied", "code-not-generated-yet"])
def test_a_failing_call_raises_the_explanation_from_the_error(make, capsys):
    gm = make()
    assert torch.equal(gm(torch.ones(2, 3)), torch.full((2,), 2.0))
    for _ in range(2):  # the first call of a module without code generates it: both calls explained
        with pytest.raises(ValueError, match="x has rank 1") as caught:
            gm(torch.ones(3))
        assert isinstance(caught.value.__cause__, IndexError)
    assert BANNER not in capsys.readouterr().err


def test_an_unexplained_failure_is_raised_as_it_was_also_after_recompile():
    gm = _explained(fx.symbolic_trace(_Rows()))
    with pytest.raises(TypeError, match="^text is no tensor$") as caught:
        gm("text")  # a TypeError the explanation leaves alone
    assert caught.value.__cause__ is None
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        output.args = (gm.graph.call_function(torch.neg, (output.args[0],)),)
    gm.recompile()
    assert torch.equal(gm(torch.ones(2, 3)), torch.full((2,), -2.0))
    with pytest.raises(ValueError, match="x has rank 1"):
        gm(torch.ones(3))


def test_each_model_explains_its_own_failures():
    """The wrapper is set on the instance's own class, never on GraphModule's."""
    first = _explained(fx.symbolic_trace(_Rows()))
    second = fx.symbolic_trace(_Rows())
    explain_failures(second, lambda gm, args, kwargs, error: LookupError("the second model's"))
    with pytest.raises(ValueError, match="x has rank 1"):
        first(torch.ones(3))
    with pytest.raises(LookupError, match="the second model's"):
        second(torch.ones(3))


def test_an_explanation_that_fails_leaves_the_error_as_it_was():
    gm = fx.symbolic_trace(_Rows())
    explain_failures(gm, lambda gm, args, kwargs, error: 1 / 0)
    with pytest.raises(TypeError, match="^text is no tensor$"):
        gm("text")
