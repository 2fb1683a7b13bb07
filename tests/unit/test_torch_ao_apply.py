"""torch.ao's QAT switches passed to ``model.apply`` act on qplug's fake quants and QAT modules
exactly as qplug's own helpers do (torch.ao is only the source of the helpers here)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.nn import qat

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")
aq = pytest.importorskip("torch.ao.quantization")
ao_qat = pytest.importorskip("torch.ao.nn.intrinsic.qat")


def _prepared() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    prepared = qp.prepare_qat_fx(model.train(), None, (torch.randn(2, 3, 6, 6),), backend="fbgemm")
    prepared(torch.randn(8, 3, 6, 6))
    return prepared


def _moving_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()
            if k.endswith(("min_val", "max_val", "running_mean", "running_var"))}


PAIRS = [
    ((aq.disable_observer, ao_qat.freeze_bn_stats), (qp.observers.disable_observer, qat.freeze_bn_stats)),
    ((aq.disable_fake_quant,), (qp.observers.disable_fake_quant,)),
]


@pytest.mark.parametrize(("ao_helpers", "qplug_helpers"), PAIRS)
def test_torch_ao_switches_set_the_same_states_as_qplugs(ao_helpers, qplug_helpers):
    by_ao = _prepared()
    by_qplug = copy.deepcopy(by_ao)
    for fn in ao_helpers:
        by_ao.apply(fn)
    for fn in qplug_helpers:
        by_qplug.apply(fn)
    assert by_ao.state_dict().keys() == by_qplug.state_dict().keys()
    for key, value in by_qplug.state_dict().items():
        assert torch.equal(by_ao.state_dict()[key], value), key
    x = torch.randn(8, 3, 6, 6) * 3
    assert torch.equal(by_ao(x), by_qplug(x))


def test_torch_ao_freeze_stops_every_observer_and_bn_of_a_qplug_qat_model():
    prepared = _prepared()
    prepared.apply(aq.disable_observer)
    prepared.apply(ao_qat.freeze_bn_stats)
    before = _moving_state(prepared)
    prepared(torch.randn(8, 3, 6, 6) * 3)
    assert all(torch.equal(before[k], v) for k, v in _moving_state(prepared).items())
    prepared.apply(aq.enable_observer)
    prepared.apply(ao_qat.update_bn_stats)
    prepared(torch.randn(8, 3, 6, 6) * 3)
    assert any(not torch.equal(before[k], v) for k, v in _moving_state(prepared).items())


def test_other_functions_pass_through_apply():
    seen: list[str] = []
    _prepared().apply(lambda m: seen.append(type(m).__name__))
    assert "FakeQuantize" in seen and "ConvBnReLU2d" in seen
