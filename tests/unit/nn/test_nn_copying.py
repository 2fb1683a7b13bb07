"""Copying what a captured graph shares with the user's model (qplug_core.nn.copying)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.nn.copying import copy_module, detach_from


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _shares_anything(a: nn.Module, b: nn.Module) -> bool:
    modules = {id(m) for m in a.modules()}
    storages = {t.untyped_storage().data_ptr() for t in _tensors(a) if t.numel()}
    return any(id(m) in modules for m in b.modules()) or any(
        t.numel() and t.untyped_storage().data_ptr() in storages for t in _tensors(b))


@pytest.mark.parametrize("module", [nn.Conv2d(3, 4, 3, padding="same"), nn.BatchNorm2d(4),
                                    nn.Linear(4, 2), nn.ReLU(inplace=True), nn.LayerNorm(4)],
                         ids=lambda m: type(m).__name__)
def test_copy_module_equals_deepcopy_and_shares_nothing(module):
    seen = []
    module.register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    copied = copy_module(module)
    reference = copy.deepcopy(module)
    assert type(copied) is type(module) and not _shares_anything(module, copied)
    assert copied.state_dict().keys() == reference.state_dict().keys()
    for key, value in copied.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[key], rtol=0, atol=0)
    assert [p.requires_grad for p in copied.parameters()] == [p.requires_grad for p in module.parameters()]
    assert all(type(p) is nn.Parameter for p in copied.parameters())
    x = torch.randn(2, 3, 5, 5) if isinstance(module, nn.Conv2d) else torch.randn(2, 4, 5, 5) \
        if isinstance(module, nn.BatchNorm2d) else torch.randn(2, 4)
    torch.testing.assert_close(copied.eval()(x.clone()), module.eval()(x.clone()))
    assert seen == [type(module).__name__] * 2  # the user's hook came along, as with deepcopy
    copied.register_forward_hook(lambda m, i, o: seen.append("copy only"))
    module(x.clone())
    assert "copy only" not in seen  # hooks added to the copy do not reach the original


def test_copy_module_deep_copies_what_it_cannot_copy_field_by_field():
    lstm = nn.LSTM(4, 3)  # keeps its weights in a list too (_flat_weights)
    copied = copy_module(lstm)
    assert not _shares_anything(lstm, copied)
    assert all(a is b for a, b in zip(copied._flat_weights, copied.parameters()))


def test_detach_from_keeps_tied_weights_tied_and_shares_nothing():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).eval()
    model[2].weight = model[0].weight
    gm = torch.fx.symbolic_trace(model)
    assert _shares_anything(model, gm)
    detach_from(model, gm)
    assert not _shares_anything(model, gm)
    assert gm.get_submodule("0").weight is gm.get_submodule("2").weight
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm(x), model(x))


def test_prepare_qat_and_training_leave_the_float_model_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 2))
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 3, 8, 8)
    observed = qp.prepare_qat_fx(model, None, (x,), backend="reference")
    assert not _shares_anything(model, observed)
    optimizer = torch.optim.SGD(observed.parameters(), lr=0.1)
    observed(x).sum().backward()
    optimizer.step()
    assert model.training and all(m.training for m in model.modules())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
