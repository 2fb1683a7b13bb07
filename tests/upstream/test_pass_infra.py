"""Port of PyTorch's ``test/fx/test_pass_infra.py`` (TestPassManager).

Translation: ``torch.fx.passes.infra.pass_manager.PassManager`` / ``this_before_that_pass_constraint``
-> ``qp.passes.PassManager`` / ``qp.passes.this_before_that_pass_constraint``. Deliberate
differences (docs/migrating.md, "Found by porting PyTorch's tests"): qplug's PassManager runs on a
copy unless ``inplace=True`` (the result's ``graph_module`` carries the changes), and failed or
malformed checks raise ``PassError`` (a ``RuntimeError``) chained to the check's own exception.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import qplug_core as qp
from qplug_core.errors import PassError


def replace_add_with_mul_pass(gm):
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == torch.add:
            node.target = torch.mul


def replace_mul_with_sub_pass(gm):
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == torch.mul:
            node.target = torch.div


class AddModule(torch.nn.Module):
    def forward(self, x):
        y = torch.add(x, x)
        z = torch.add(y, x)
        return z


def test_pass_manager():
    """Tests that the pass manager runs the passes correctly."""
    m = AddModule()
    traced_m = torch.fx.symbolic_trace(m)
    pm = qp.passes.PassManager(passes=[replace_add_with_mul_pass, replace_mul_with_sub_pass], steps=5)
    pm.validate_constraints()
    assert len(pm.passes) == 2
    # upstream: pm(traced_m) edits traced_m; qplug returns the transformed copy
    result = pm(traced_m)
    for node in result.graph_module.graph.nodes:
        if node.op == "call_function":
            assert node.target == torch.div
    # and with inplace=True it edits the module itself, as upstream
    qp.passes.PassManager([replace_add_with_mul_pass, replace_mul_with_sub_pass], steps=5,
                          inplace=True)(traced_m)
    assert all(n.target == torch.div for n in traced_m.graph.nodes if n.op == "call_function")


def test_this_before_that_pass_constraint():
    """Tests the construction of constraints."""
    passes = [lambda x: 2 * x for _ in range(10)]
    pm = qp.passes.PassManager(passes)
    # add unfulfillable constraint
    pm.add_constraint(qp.passes.this_before_that_pass_constraint(passes[-1], passes[0]))
    with pytest.raises(RuntimeError):  # PassError is a RuntimeError
        pm.validate_constraints()


def test_pass_manager_checks():
    """Tests that users can add in check functions correctly."""
    m = AddModule()
    traced_m = fx.symbolic_trace(m)
    pm = qp.passes.PassManager(passes=[replace_add_with_mul_pass, replace_mul_with_sub_pass])

    def check_div_target(graph_module):
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and node.target != torch.div:
                raise ValueError("Target should be div!")
    pm.add_checks(check_div_target)
    # upstream: assertRaises(ValueError); qplug: PassError chained to the ValueError
    with pytest.raises(PassError, match="Target should be div!") as raised:
        pm(traced_m)
    assert isinstance(raised.value.__cause__, ValueError)


def test_pass_manager_bad_checks():
    """Checks that we error if we pass in a check function with the wrong parameters."""
    def check_bad_args(graph_module, i):
        pass

    pm = qp.passes.PassManager()
    # upstream: TypeError; qplug: PassError naming the check and the expected signature
    with pytest.raises(PassError, match="takes 2 parameters"):
        pm.add_checks(check_bad_args)
