"""Defects an exploratory QAT session found (s19/qat): each test is the user's QAT run, with the
numbers a user relies on (the frozen fake-quant model, torch.ao's) or the state they expect back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.nn.qat import freeze_bn_stats

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class ConvPoolNet(nn.Module):
    """conv-bn-relu -> adaptive avg pool -> torch.flatten -> linear: the pool and the flatten share
    the conv output's fake-quant, in torch.ao as in qplug."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.pool, self.fc = nn.AdaptiveAvgPool2d(2), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.relu(self.bn(self.conv(x)))), 1))


def _train(prepared: nn.Module, steps: int, *, freeze_at: int | None = None) -> list[float]:
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        if step == freeze_at:
            prepared.apply(qp.observers.disable_observer)
            prepared.apply(freeze_bn_stats)
        x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
        loss = nn.functional.cross_entropy(prepared(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _prepared() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return qp.prepare_qat_fx(ConvPoolNet(), None, (torch.randn(2, 1, 8, 8),), backend="fbgemm")


def test_a_state_dict_checkpoint_keeps_the_batch_norm_freeze():
    """After the documented freeze, a run resumed from ``state_dict`` kept the observer freeze but
    not the BN freeze: BN statistics moved again (running_mean by 0.0038 in one step)."""
    prepared = _prepared()
    _train(prepared, 4, freeze_at=2)
    resumed = _prepared()
    resumed.load_state_dict(prepared.state_dict())
    assert resumed.conv.freeze_bn is True and not resumed.conv.bn.training
    before = resumed.conv.bn.running_mean.clone()
    resumed(torch.randn(16, 1, 8, 8))
    assert torch.equal(resumed.conv.bn.running_mean, before)
    # a checkpoint saved before the flag existed loads as not frozen; torch.ao-style code sets it
    older = {k: v for k, v in prepared.state_dict().items() if not k.endswith("bn_frozen")}
    resumed.load_state_dict(older)
    assert resumed.conv.freeze_bn is False and resumed.conv.bn.training
    resumed.conv.freeze_bn = True
    assert resumed.state_dict()["conv.bn_frozen"].item() == 1


def test_qat_with_a_shared_pool_and_flatten_fake_quant_is_torch_ao_s():
    """conv -> pool -> torch.flatten calls one fake-quant three times per forward, as torch.ao
    does, and trains bit for bit like torch.ao with the same qconfig (the guide said "twice")."""
    from torch.ao.quantization import (
        FakeQuantize,
        MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
        QConfig,
        QConfigMapping,
    )
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    eps = torch.finfo(torch.float32).eps
    qconfig = QConfig(
        activation=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, dtype=torch.quint8,
                                          quant_min=0, quant_max=255, eps=eps),
        weight=FakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, dtype=torch.qint8,
                                      quant_min=-128, quant_max=127, eps=eps,
                                      qscheme=torch.per_channel_symmetric, ch_axis=0))
    torch.manual_seed(0)
    ao = prepare_qat_fx(ConvPoolNet().train(), QConfigMapping().set_global(qconfig), (torch.randn(2, 1, 8, 8),))
    prepared = _prepared()
    calls: dict[int, int] = {}
    for module in prepared.modules():
        if isinstance(module, qp.observers.FakeQuantize):
            module.register_forward_hook(lambda m, i, o: calls.__setitem__(id(m), calls.get(id(m), 0) + 1))
    prepared(torch.randn(2, 1, 8, 8))
    assert sorted(calls.values()) == [1, 1, 1, 1, 3]  # 3: conv output, pool, flatten
    torch.manual_seed(0)
    prepared = _prepared()
    assert _train(prepared, 6) == _train(ao, 6)


def test_a_per_channel_learnable_weight_fake_quant_is_sized_per_layer():
    """(s26/qat F6) A QConfig cannot know each layer's channel count: a per-channel
    ``LearnableFakeQuantize`` weight had one scale for 8 channels and the first forward raised
    torch's "expanded size of the tensor (1) must match ... (8)"."""
    from qplug_core.observers import (
        LearnableFakeQuantize,
        MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
    )

    weight = LearnableFakeQuantize.with_args(
        observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
        dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)
    activation = LearnableFakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=0,
                                                 quant_max=255, dtype=torch.quint8)
    mapping = qp.QConfigMapping().set_global(qp.QConfig(activation=activation, weight=weight))
    torch.manual_seed(0)
    prepared = qp.prepare_qat_fx(ConvPoolNet(), mapping, (torch.randn(2, 1, 8, 8),), backend="fbgemm")
    _train(prepared, 2)
    prepared.apply(lambda m: m.enable_param_learning() if isinstance(m, LearnableFakeQuantize) else None)
    _train(prepared, 2)
    scale = prepared.conv.weight_fake_quant.scale
    assert scale.shape == (8,) and scale.grad is not None and len(set(scale.tolist())) == 8


def test_a_per_channel_learnable_weight_with_the_wrong_channel_len_is_refused_at_prepare():
    from qplug_core.observers import LearnableFakeQuantize, MovingAveragePerChannelMinMaxObserver

    weight = LearnableFakeQuantize.with_args(
        observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
        qscheme=torch.per_channel_symmetric, ch_axis=0, channel_len=4)
    mapping = qp.get_default_qconfig_mapping("fbgemm", "qat")
    mapping.set_global(qp.QConfig(activation=mapping.global_qconfig.activation, weight=weight))
    with pytest.raises(qp.errors.ConfigValidationError, match="channel_len=4 for a weight with 8 channels"):
        qp.prepare_qat_fx(ConvPoolNet(), mapping, (torch.randn(2, 1, 8, 8),), backend="fbgemm")


def _steps(prepared: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(prepared(torch.randn(4, 1, 8, 8)), torch.randint(0, 10, (4,))).backward()
        optimizer.step()


def test_an_optimizer_built_on_the_float_model_before_prepare_qat_is_named_once(recwarn):
    """(s26/qat F3) torch.ao's prepare_qat_fx reused the float model's parameters; qplug's copy
    does not, so the torch.ao habit trained nothing, silently."""
    torch.manual_seed(0)
    model = ConvPoolNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    prepared = qp.prepare_qat_fx(model, None, (torch.randn(2, 1, 8, 8),), backend="fbgemm")
    _steps(prepared, optimizer, 30)
    warned = [str(w.message) for w in recwarn if "build the optimizer on the returned model" in str(w.message)]
    assert len(warned) == 1 and "is it built on the float model?" in warned[0]


@pytest.mark.parametrize("flow", ["graph", "eager"])
def test_an_optimizer_on_the_qat_model_trains_without_that_warning(recwarn, flow):
    torch.manual_seed(0)
    if flow == "graph":
        prepared = _prepared()
    else:
        prepared = qp.eager.prepare_qat(qp.eager.QuantWrapper(ConvPoolNet()), backend="fbgemm")
    _steps(prepared, torch.optim.SGD(prepared.parameters(), lr=0.05), 30)
    assert [w for w in recwarn if "build the optimizer on the returned model" in str(w.message)] == []


def test_gradient_accumulation_and_another_models_optimizer_do_not_warn(recwarn):
    """Micro-batches accumulate gradients over many forwards before one step (the watch counting
    forwards warned after 20); a float model's optimizer stepping beside the QAT model's (a GAN's
    discriminator) and backward passes with no step at all (gradients for analysis) are training too."""
    torch.manual_seed(0)
    prepared, critic = _prepared(), nn.Linear(10, 1)
    own, other = torch.optim.SGD(prepared.parameters(), lr=0.05), torch.optim.SGD(critic.parameters(), lr=0.05)
    for _ in range(3):
        for _ in range(25):  # micro-batches
            nn.functional.cross_entropy(prepared(torch.randn(4, 1, 8, 8)), torch.randint(0, 10, (4,))).backward()
        critic(prepared(torch.randn(4, 1, 8, 8)).detach()).sum().backward()
        other.step()
        own.step()
        own.zero_grad()
    assert [w for w in recwarn if "build the optimizer on the returned model" in str(w.message)] == []


def test_qat_models_add_one_optimizer_hook_per_process_however_many_are_prepared():
    """(s27 review) each QAT prepare registered a global optimizer-step hook, removed only by a
    step: models converted to a copy or deleted left theirs, run by every step of the process; and
    adding or removing one while another thread's optimizer stepped broke that step."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    from qplug_core.flows import untrained

    for _ in range(3):
        prepared = _prepared()
        prepared(torch.randn(2, 1, 8, 8))
        qp.convert_fx(prepared.eval())
    assert [h for h in _global_optimizer_pre_hooks.values() if h is untrained._step] == [untrained._step]
