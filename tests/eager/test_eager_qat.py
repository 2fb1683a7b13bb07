"""Eager QAT's input observers (s26/qat): the depthwise conv's input is fake-quantized to fbgemm's
7-bit qparams by an observer that is no child module. ``disable_observer`` freezes it, and the state
dict carries it, so a frozen model answers the same every pass and a checkpoint resumes exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.eager import DeQuantStub, QuantStub
from qplug_core.nn.qat import freeze_bn_stats

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class DepthwiseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.depthwise(self.relu(self.bn(self.conv(self.quant(x)))))
        return self.dequant(self.fc(torch.flatten(x, 1)))


def _prepared() -> nn.Module:
    torch.manual_seed(0)
    model = qp.eager.fuse_modules_qat(DepthwiseNet().train(), [["conv", "bn", "relu"]])
    return qp.eager.prepare_qat(model, backend="fbgemm")


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(seed))


def _train(model: nn.Module, seeds: range) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for seed in seeds:
        optimizer.zero_grad()
        model(_batch(seed) * (1 + seed)).pow(2).mean().backward()  # growing inputs: ranges move
        optimizer.step()


def _frozen(model: nn.Module) -> nn.Module:
    model.apply(qp.observers.disable_observer)
    model.apply(freeze_bn_stats)
    return model.eval()


def test_disable_observer_freezes_the_input_fake_quant_of_a_depthwise_conv():
    prepared = _prepared()
    _train(prepared, range(3))
    frozen = _frozen(prepared)
    with torch.no_grad():
        first = frozen(_batch(9) * 0.2)  # narrower than training's: a live observer narrows
        second = frozen(_batch(9) * 0.2)
    assert torch.equal(first, second)


def test_torch_ao_switches_freeze_the_same_states_as_qplugs_input_fake_quants_included():
    ao_qat = pytest.importorskip("torch.ao.nn.intrinsic.qat")
    aq = pytest.importorskip("torch.ao.quantization")
    by_qplug = _prepared()
    _train(by_qplug, range(3))
    by_ao = copy.deepcopy(by_qplug)
    _frozen(by_qplug).train()
    by_ao.apply(aq.disable_observer)
    by_ao.apply(ao_qat.freeze_bn_stats)
    for model in (by_qplug, by_ao):
        model(_batch(9) * 5)  # a training-mode batch far wider than before: any live state moves
    assert by_ao.state_dict().keys() == by_qplug.state_dict().keys()
    for key, value in by_qplug.state_dict().items():
        assert torch.equal(by_ao.state_dict()[key], value), key


def test_a_mid_qat_checkpoint_restores_the_input_observers():
    trained = _prepared()
    _train(trained, range(3))
    state = trained.state_dict()
    assert "depthwise.activation_pre_process.scale" in state
    resumed = _prepared()
    assert str(resumed.load_state_dict(state)) == "<All keys matched successfully>"
    with torch.no_grad():
        assert torch.equal(_frozen(trained)(_batch(9)), _frozen(resumed)(_batch(9)))


def test_a_checkpoint_without_input_observers_still_loads_strictly():
    state = {k: v for k, v in _prepared().state_dict().items() if "activation_pre_process" not in k}
    assert str(_prepared().load_state_dict(state)) == "<All keys matched successfully>"
