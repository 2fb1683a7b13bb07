"""FakeQuantize modules: switches, saturation, state dicts, LSQ learning."""

from __future__ import annotations

import pytest
import torch

from qplug_core import observers as obs
from qplug_core.errors import ConfigValidationError, UncalibratedObserverError


def test_switches_and_module_level_helpers() -> None:
    model = torch.nn.Sequential(obs.default_fake_quant(), torch.nn.ReLU(),
                                obs.default_weight_fake_quant())
    x = torch.linspace(-3, 3, 101)
    model.apply(obs.disable_fake_quant)
    assert torch.equal(model(x), torch.relu(x))  # observers still ran
    assert model[0].activation_post_process.has_data
    model.apply(obs.enable_fake_quant)
    model.apply(obs.disable_observer)
    before = model[0].scale.clone()
    y = model[0](x * 10)  # range grows, but the observer is off: qparams frozen
    assert torch.equal(model[0].scale, before)
    assert y.max().item() == pytest.approx(3.0, abs=model[0].scale.item())
    model.apply(obs.enable_observer)
    model[0](x * 10)
    assert model[0].scale.item() > before.item()


def test_fake_quant_mirrors_observer_attributes_and_name() -> None:
    fq = obs.default_per_channel_weight_fake_quant(ch_axis=1)
    assert (fq.dtype, fq.qscheme, fq.quant_min, fq.quant_max, fq.ch_axis) == (
        torch.qint8, torch.per_channel_symmetric, -128, 127, 1)
    fq.name = "fc1.weight_fake_quant"
    assert fq.activation_post_process.name == "fc1.weight_fake_quant"
    fq(torch.randn(3, 4))
    qp = fq.qparams()
    assert qp.axis == 1 and qp.scale.shape == (4,)


def test_per_channel_fake_quant_saturates_where_torch_wraps() -> None:
    fq = obs.default_per_channel_weight_fake_quant()
    fq(torch.tensor([[1.0, -1.0], [2.0, -2.0]]))
    fq.disable_observer()
    huge = torch.tensor([[1e20, -1e20], [3e9, -3e9]])
    expected = torch.tensor([[127.0, -128.0], [127.0, -128.0]]) * fq.scale[:, None]
    assert torch.equal(fq(huge), expected)


def test_state_dict_round_trip_restores_per_channel_qparams() -> None:
    src = obs.default_per_channel_weight_fake_quant()
    src(torch.randn(5, 3))
    dst = obs.default_per_channel_weight_fake_quant()
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.scale, src.scale) and torch.equal(dst.zero_point, src.zero_point)
    x = torch.randn(5, 3)
    src.disable_observer()
    dst.disable_observer()
    assert torch.equal(src(x), dst(x))


def test_fixed_qparams_fake_quant_needs_fixed_observer() -> None:
    with pytest.raises(ConfigValidationError, match="FixedQParamsObserver"):
        obs.FixedQParamsFakeQuantize(observer=obs.MinMaxObserver)
    fq = obs.default_fixed_qparams_range_0to1_fake_quant()
    assert fq(torch.tensor([0.5, 2.0])).tolist() == [0.5, 255 / 256]


@pytest.mark.parametrize("factory", [obs.default_fake_quant, obs.default_per_channel_weight_fake_quant])
def test_fake_quant_whose_observer_never_saw_data_raises_instead_of_using_scale_1(factory) -> None:
    """Disabled before any batch, it fake-quantized with its initial scale=1, zero_point=0 (per
    channel: "1 scales / 1 zero points for 4 channels"); torch.ao does the same, the README says never."""
    fq = factory()
    fq.name = "fc.weight_fake_quant"
    fq.disable_observer()
    x = torch.tensor([[0.123, 0.6, 3.7], [-1.0, 0.2, 0.3], [0.0, 0.5, 1.0], [2.0, -2.0, 0.1]])
    with pytest.raises(UncalibratedObserverError, match=r"FakeQuantize 'fc.weight_fake_quant' fake-quantizes, "
                       r"but its observer was disabled before it saw any data, .* enable the observer "
                       r"\(enable_observer\(\), .*for at least one training batch") as info:
        fq(x)
    assert info.value.nodes == ("fc.weight_fake_quant",)
    fq.disable_fake_quant()
    assert torch.equal(fq(x), x)  # nothing to quantize with, nothing asked for
    fq.enable_fake_quant()
    fq.enable_observer()
    fq(x)
    fq.disable_observer()
    assert torch.equal(fq(x), fq(x * 1.0))  # observed once: frozen qparams, as before


def test_learnable_fake_quant_passes_an_empty_first_batch_through_as_fake_quantize_does() -> None:
    for cls in (obs.FakeQuantize, obs.LearnableFakeQuantize):
        fq = cls(quant_min=0, quant_max=255, dtype=torch.quint8)
        empty = torch.randn(0, 8)
        assert fq(empty).shape == (0, 8)
        assert not fq.has_data
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        step = float(fq(x).sub(x).abs().max())  # the first real batch initialises the qparams
        assert fq.has_data and 0 < step <= float(fq.qparams().scale) / 2 + 1e-6


def test_learnable_fake_quantize_learns_a_better_scale() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g)
    fq = obs.LearnableFakeQuantize(quant_min=0, quant_max=255, use_grad_scaling=True)
    fq(x)  # initialised from the observer...
    fq.enable_param_learning()
    with torch.no_grad():
        fq.scale.mul_(4.0)  # ...then spoiled, so that there is something to learn
    opt = torch.optim.Adam(fq.parameters(), lr=0.01)
    losses = []
    for _ in range(100):
        opt.zero_grad()
        loss = ((fq(x) - x) ** 2).mean()
        losses.append(loss.item())
        loss.backward()
        opt.step()
    assert losses[-1] < 0.3 * losses[0]
    qp = fq.qparams()
    assert qp.zero_point.dtype == torch.int64 and 0 <= int(qp.zero_point) <= 255



@pytest.mark.parametrize("qscheme", [torch.per_tensor_affine, torch.per_tensor_symmetric])
def test_learnable_fake_quantize_called_twice_in_one_forward_gets_both_sites_gradients(qscheme) -> None:
    """prepare_qat_fx shares one activation fake-quant between a fused pattern's output and the
    reshape after it, so LSQ runs twice per forward; writing its parameters in place failed the
    first backward ("modified by an inplace operation"). Each site's gradient is the one of the
    qparams it ran with, as two frozen copies holding those qparams give."""
    import copy

    def learnable() -> obs.LearnableFakeQuantize:
        return obs.LearnableFakeQuantize(observer=obs.MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                         dtype=torch.quint8, qscheme=qscheme)

    torch.manual_seed(0)
    x = torch.randn(8, 16) * 3
    shared, leaf = learnable(), x.clone().requires_grad_()
    out = shared(leaf) * 2 + shared(leaf.relu())
    out.square().sum().backward()

    tracking, sites = learnable(), []
    for site_input in (x, x.relu()):
        tracking(site_input)
        sites.append(copy.deepcopy(tracking))
        sites[-1].apply(obs.disable_observer)
    twin_leaf = x.clone().requires_grad_()
    twin_out = sites[0](twin_leaf) * 2 + sites[1](twin_leaf.relu())
    twin_out.square().sum().backward()
    assert torch.equal(out, twin_out)
    assert torch.equal(leaf.grad, twin_leaf.grad)
    assert torch.allclose(shared.scale.grad, sites[0].scale.grad + sites[1].scale.grad)
    assert torch.allclose(shared.zero_point.grad, sites[0].zero_point.grad + sites[1].zero_point.grad)
