"""layer_parity: each int8 region of the reference form, run by a backend's compile function on
the reference's own integer inputs, compared with the reference's integer outputs."""

from __future__ import annotations

import copy

import pytest
import torch

import qplug_core as qp
from qplug_core.errors import PluginContractError
from qplug_core.flows.kernel_check import float_step, steps_off
from qplug_core.flows.region_parity import _compare
from qplug_core.kernels.reference import ReferenceWeighted
from qplug_core.plugin_api import layer_parity


def _reference():
    model = qp.zoo.get_model("digits_cnn", seed=0)
    example = qp.zoo.example_inputs("digits_cnn", batch=4, seed=0)
    observed = qp.prepare_fx(model, None, example, backend="reference")
    qp.calibrate(observed, [qp.zoo.example_inputs("digits_cnn", batch=4, seed=s) for s in range(3)])
    return qp.convert_to_reference_fx(observed), qp.zoo.example_inputs("digits_cnn", batch=4, seed=9)


def test_the_reference_form_itself_agrees_exactly_on_every_region():
    reference, x = _reference()
    parity = layer_parity(reference, lambda gm, example: copy.deepcopy(gm), x)
    quantizes = [n for n in reference.graph.nodes if n.op == "call_module"
                 and type(reference.get_submodule(n.target)).__name__ == "Quantize"]
    assert [r.name for r in parity.regions] == [n.name for n in quantizes]
    assert parity.within == 1.0 and all(r.max_steps == 0 for r in parity.regions)


def test_a_region_computed_differently_is_the_one_reported():
    reference, x = _reference()

    def wrong_first_layer(gm, example):
        compiled = copy.deepcopy(gm)
        weighted = next(m for m in compiled.modules() if isinstance(m, ReferenceWeighted))
        with torch.no_grad():
            next(weighted.module.parameters()).mul_(1.5)
        return compiled

    parity = layer_parity(reference, wrong_first_layer, x)
    worst = parity.worst
    assert worst.within < 0.9 and worst.max_steps > 1
    assert sum(r.within < 1.0 for r in parity.regions) == 1, "teacher forcing keeps the error local"
    first_weighted = next(n for n in reference.graph.nodes if n.op == "call_module"
                          and isinstance(reference.get_submodule(n.target), ReferenceWeighted))
    assert worst.name == next(iter(first_weighted.users)).name


def _shifted(gm, example):
    """Every quantize writes its codes one step up (a zero-point off by one)."""
    compiled = copy.deepcopy(gm)
    for module in compiled.modules():
        if type(module).__name__ == "Quantize":
            module.zero_point += 1
    return compiled


def test_a_region_one_step_off_on_every_element_shows_its_bias():
    """Within one step on every element, as rounding ties are: only the mean says it is biased."""
    reference, x = _reference()
    parity = layer_parity(reference, _shifted, x)
    assert parity.within == 1.0
    assert all(abs(r.bias - 1.0) < 0.05 for r in parity.regions if r.elements)
    assert all(r.bias == 0.0 for r in layer_parity(reference, lambda gm, example: copy.deepcopy(gm), x).regions)


def test_ok_and_assert_ok_hold_each_region_to_convert_s_contract_bias_included():
    """``within`` passes a compile one step off on every element; ``ok``/``assert_ok()`` do not
    (a backend's parity test asserting ``within`` alone shipped that bias)."""
    reference, x = _reference()
    right = layer_parity(reference, lambda gm, example: copy.deepcopy(gm), x)
    assert right.ok and right.problems == {}
    right.assert_ok()
    shifted = layer_parity(reference, _shifted, x)
    assert not shifted.ok and set(shifted.problems) == {r.name for r in shifted.regions if r.elements}
    with pytest.raises(PluginContractError, match=rf"{len(shifted.problems)} of {len(shifted.regions)} int8 "
                                                  r"region\(s\) break the kernel contract: int8 region \S+, .* "
                                                  r"off by \+1.00 steps on average \(at most 0.25 either way"):
        shifted.assert_ok()


def test_a_region_of_the_wrong_shape_is_named_with_both_shapes():
    reference, x = _reference()

    def dropping_a_column(gm, example):
        compiled = copy.deepcopy(gm)

        def forward(*args):
            return tuple(out[..., :-1] for out in gm(*args))
        compiled.forward = forward
        return compiled

    with pytest.raises(PluginContractError, match=r"int8 region \w+: the compiled module returned shape "
                                                  r"\(4, \d+(, \d+)*\), expected shape \(4, \d+(, \d+)*\)"):
        layer_parity(reference, dropping_a_column, x)


def test_a_float_output_one_step_off_is_one_step_as_in_the_kernel_contract():
    """range / 255 added in float32 is a hair over one step; both checks count it as one."""
    want = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 3
    got = want + float_step(want)
    assert int(steps_off(got, want, float_step(want)).max()) == 1
    parity = _compare("r", got, want, 1)
    assert parity.within == 1.0 and parity.max_steps == 1
