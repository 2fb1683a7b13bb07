"""PassManager: ordering, constraint cycles, fixpoint, checks, return types, failure safety."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from qplug_core.errors import PassError
from qplug_core.passes import PassBase, PassManager, PassResult, this_before_that_pass_constraint


def f(x, y):
    return torch.relu(x + y) + y


@pytest.fixture
def gm() -> fx.GraphModule:
    return fx.symbolic_trace(f)


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def replace_add_with_div(gm: fx.GraphModule) -> PassResult:
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.add:
            n.target = torch.div
    return PassResult(gm, True)


def replace_div_with_mul(gm: fx.GraphModule) -> PassResult:
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.div:
            n.target = torch.mul
    return PassResult(gm, True)


def test_runs_passes_in_order_and_leaves_input_alone(gm):
    before = gm.code
    out = PassManager([replace_add_with_div, replace_div_with_mul])(gm)
    assert out.modified
    assert targets(out.graph_module) == [torch.mul, torch.relu, torch.mul]
    assert gm.code == before  # default works on a copy


def test_inplace_edits_the_given_module(gm):
    out = PassManager([replace_add_with_div], inplace=True)(gm)
    assert out.graph_module is gm and torch.div in targets(gm)


def test_constraints_reorder_passes(gm):
    pm = PassManager([replace_div_with_mul, replace_add_with_div],
                     constraints=[this_before_that_pass_constraint(replace_add_with_div,
                                                                   replace_div_with_mul)])
    out = pm(gm)
    assert pm.passes == [replace_add_with_div, replace_div_with_mul]
    assert torch.div not in targets(out.graph_module)


def test_validate_constraints_names_offending_passes():
    pm = PassManager([replace_div_with_mul, replace_add_with_div])
    pm.add_constraint(this_before_that_pass_constraint(replace_add_with_div, replace_div_with_mul))
    with pytest.raises(PassError, match="replace_div_with_mul.*before.*replace_add_with_div"):
        pm.validate_constraints()


def test_constraint_cycle_names_the_passes(gm):
    def p_a(g): return None
    def p_b(g): return None
    def p_c(g): return None
    pm = PassManager([p_a, p_b, p_c], constraints=[
        this_before_that_pass_constraint(p_a, p_b), this_before_that_pass_constraint(p_b, p_c),
        this_before_that_pass_constraint(p_c, p_a)])
    with pytest.raises(PassError, match="cycle") as info:
        pm(gm)
    assert all(name in str(info.value) for name in ("p_a", "p_b", "p_c"))


class CountingPass(PassBase):
    """Rewrites one add into sub per call; reports modified only when it did something."""

    def __init__(self) -> None:
        self.calls = 0

    def call(self, gm):
        self.calls += 1
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is operator.add:
                n.target = operator.sub
                return PassResult(gm, True)
        return PassResult(gm, False)


def test_steps_stop_at_fixpoint(gm):
    p = CountingPass()
    out = PassManager([p], steps=10)(gm)
    assert p.calls == 3  # two rewrites, then one round without change
    assert operator.add not in targets(out.graph_module)


def test_steps_bound_the_rounds(gm):
    p = CountingPass()
    out = PassManager([p], steps=1)(gm)
    assert p.calls == 1 and operator.add in targets(out.graph_module)


def test_check_failure_names_the_pass(gm):
    def check_div_target(g):
        for n in g.graph.nodes:
            # The seed's invariant, restricted to the binary ops this graph contains.
            if n.op == "call_function" and n.target is torch.mul:
                raise ValueError("Target should be div!")

    pm = PassManager([replace_add_with_div, replace_div_with_mul], run_checks_after_each_pass=True)
    pm.add_checks(check_div_target)
    before = gm.code
    with pytest.raises(PassError, match="check_div_target.*after pass 'replace_div_with_mul'") as info:
        pm(gm)
    assert info.value.pass_name == "replace_div_with_mul"
    assert isinstance(info.value.__cause__, ValueError)
    assert gm.code == before


def test_suppressed_check_failure_only_warns(gm, caplog):
    pm = PassManager([replace_add_with_div], run_checks_after_each_pass=True,
                     suppress_check_failures=True)
    pm.add_checks(lambda g: (_ for _ in ()).throw(ValueError("nope")))
    assert pm(gm).modified
    assert "nope" in caplog.text


def test_check_must_take_one_parameter():
    with pytest.raises(PassError, match="exactly one"):
        PassManager().add_checks(lambda a, b: None)


def test_plain_functions_are_wrapped(gm):
    def in_place(g):
        replace_add_with_div(g)  # returns None below

    def returns_module(g):
        return replace_div_with_mul(g).graph_module

    out = PassManager([lambda g: in_place(g), returns_module])(gm)
    assert out.modified and targets(out.graph_module)[0] is torch.mul


@pytest.mark.parametrize("bad", [42, "gm", (1, 2)])
def test_wrong_return_type_is_pass_error(gm, bad):
    def bad_pass(g):
        return bad
    with pytest.raises(PassError, match=f"bad_pass.*returned {type(bad).__name__}"):
        PassManager([bad_pass])(gm)


def test_failing_pass_leaves_input_unchanged(gm):
    def explode(g):
        raise RuntimeError("boom")

    before = gm.code
    with pytest.raises(PassError, match="explode") as info:
        PassManager([replace_add_with_div, explode])(gm)
    err = info.value
    assert err.pass_name == "explode" and err.completed_passes == ("replace_add_with_div",)
    assert isinstance(err.__cause__, RuntimeError)
    assert gm.code == before and torch.div not in targets(gm)


def test_lint_detects_dangling_node(gm):
    def dangle(g):
        relu = next(n for n in g.graph.nodes if n.target is torch.relu)
        with g.graph.inserting_before(relu):
            ghost = g.graph.call_function(torch.neg, (relu,))  # uses a later node
        relu.args = (ghost,)
        return PassResult(g, True)

    with pytest.raises(PassError, match="dangle") as info:
        PassManager([dangle], run_checks_after_each_pass=True)(gm)
    assert info.value.pass_name == "dangle"


def test_invalid_steps_rejected():
    with pytest.raises(PassError, match="steps"):
        PassManager(steps=0)


def test_recompile_false_leaves_forward_to_the_caller(gm):
    """A run whose graph goes into another run that recompiles skips regenerating the code:
    ``forward`` still computes the traced graph until the caller recompiles."""
    x, y = torch.tensor([1.0, -2.0]), torch.tensor([2.0, 4.0])
    traced = gm(x, y)
    PassManager([replace_add_with_div], inplace=True, recompile=False)(gm)
    assert torch.div in targets(gm)
    torch.testing.assert_close(gm(x, y), traced)  # the old code
    gm.recompile()
    torch.testing.assert_close(gm(x, y), torch.relu(x / y) / y)
    default = fx.symbolic_trace(f)
    PassManager([replace_add_with_div], inplace=True)(default)
    torch.testing.assert_close(default(x, y), torch.relu(x / y) / y)
