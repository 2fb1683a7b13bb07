"""Layers whose weight is computed (torch.nn.utils.parametrize, weight_norm, spectral_norm, and the old
hook-based weight_norm / spectral_norm) quantize like the plain layer holding the same weight, on
every path (s19/odd defects 3 and 5). The oracle is that plain layer, quantized the same way."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import qplug_core as qp
from qplug_core.errors import ModelStateError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class _Symmetric(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return (weight + weight.t()) / 2


def _symmetric(module: nn.Module) -> nn.Module:
    parametrize.register_parametrization(module, "weight", _Symmetric())
    return module


WRAPS = {"parametrizations.weight_norm": parametrizations.weight_norm,
         "parametrizations.spectral_norm": parametrizations.spectral_norm,
         "parametrize": _symmetric,
         "hook weight_norm": nn.utils.weight_norm,
         "hook spectral_norm": nn.utils.spectral_norm}
CONV_WRAPS = {k: v for k, v in WRAPS.items() if k != "parametrize"}  # a conv weight is not square


def _linear_model(wrap) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(wrap(nn.Linear(16, 16)), nn.ReLU(), nn.Linear(16, 4)).eval()


def _conv_bn_model(wrap) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(wrap(nn.Conv2d(3, 8, 3)), nn.BatchNorm2d(8), nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model


def _plain_twin(model: nn.Sequential, make) -> nn.Module:
    """The same model with its first layer's computed weight as a plain Parameter."""
    twin = make(lambda m: m)
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("0.")}, strict=False)
    with torch.no_grad():
        model(_input_for(model))  # a hook computes the weight at the call
        twin[0].weight.copy_(model[0].weight)
        twin[0].bias.copy_(model[0].bias)
    return twin


def _input_for(model: nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    shape = (8, 16) if isinstance(model[0], nn.Linear) else (4, 3, 8, 8)
    return torch.randn(shape, generator=generator)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor], x: torch.Tensor,
                      expected: torch.Tensor) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


@pytest.mark.parametrize("wrap", WRAPS.values(), ids=WRAPS.keys())
def test_the_reference_form_of_a_computed_weight_is_the_lowered_model_and_it_saves(wrap, tmp_path):
    """The reference form ran the float weight (rounding was written into a temporary): 40.7 dB
    against the lowered model instead of inf, and qp.save refused the model ("was it changed
    after convert?")."""
    model = _linear_model(wrap)
    x = _input_for(model)
    observed = qp.prepare_fx(model, None, (x,), backend="fbgemm")
    qp.calibrate(observed, [(x,), (2 * x,)])
    reference, lowered = qp.convert_to_reference_fx(observed), qp.convert_fx(observed)
    with torch.no_grad():
        assert torch.equal(reference(x), lowered(x))
    qp.save(lowered, tmp_path / "m.safetensors")
    with torch.no_grad():
        assert torch.equal(qp.load(tmp_path / "m.safetensors")(x), lowered(x))


@pytest.mark.parametrize("capture", ["auto", "symbolic", "export"])
@pytest.mark.parametrize("wrap", CONV_WRAPS.values(), ids=CONV_WRAPS.keys())
def test_conv_bn_relu_with_a_computed_weight_quantizes_as_the_plain_conv(wrap, capture):
    """Folding BatchNorm into a parametrized conv raised a PluginHookError telling the user to
    disable fbgemm; the hook-based weight_norm gave torch's deepcopy error. The user's model,
    including the hook module deepcopy refuses, stays as it was."""
    model = _conv_bn_model(wrap)
    x = _input_for(model)
    before, float_out = _snapshot(model), model(x)
    calibration = [(x,), (x.flip(0),)]
    int8 = qp.quantize(model, (x,), calibration, backend="fbgemm", capture=capture)
    oracle = qp.quantize(_plain_twin(model, _conv_bn_model), (x,), calibration, backend="fbgemm",
                         capture=capture)
    with torch.no_grad():
        assert torch.equal(int8(x), oracle(x))
    _assert_unchanged(model, before, x, float_out)


@pytest.mark.parametrize("make", [_linear_model, _conv_bn_model])
@pytest.mark.parametrize("wrap", [parametrizations.weight_norm, nn.utils.weight_norm],
                         ids=["parametrizations", "hook"])
def test_fuse_fx_of_a_computed_weight_returns_a_model_that_runs_as_the_float_one(wrap, make):
    """The hook-based weight_norm's fused model raised "cannot assign 'torch.FloatTensor' as
    parameter 'weight'" when called: its hook overwrote the folded weight."""
    model = make(wrap)
    x = _input_for(model)
    with torch.no_grad():
        torch.testing.assert_close(qp.fuse_fx(model, backend="fbgemm")(x), model(x))


@pytest.mark.parametrize("wrap", WRAPS.values(), ids=WRAPS.keys())
def test_dynamic_quantization_of_a_computed_weight_is_that_of_the_plain_layer(wrap):
    model = _linear_model(wrap)
    x = _input_for(model)
    before, float_out = _snapshot(model), model(x)
    int8 = qp.quantize_dynamic(model, backend="fbgemm")
    oracle = qp.quantize_dynamic(_plain_twin(model, _linear_model), backend="fbgemm")
    with torch.no_grad():
        assert torch.equal(int8(x), oracle(x))
    _assert_unchanged(model, before, x, float_out)


@pytest.mark.parametrize("wrap", [parametrizations.weight_norm, nn.utils.weight_norm],
                         ids=["parametrizations", "hook"])
def test_eager_conv_bn_relu_with_weight_norm_quantizes_as_the_plain_conv(wrap):
    def make(inner_wrap):
        model = _conv_bn_model(inner_wrap)
        return nn.Sequential(qp.eager.QuantStub(), *model, qp.eager.DeQuantStub()).eval()

    def eager_int8(model):
        fused = qp.eager.fuse_modules(model, [["1", "2", "3"]])
        prepared = qp.eager.prepare(fused, backend="fbgemm")
        prepared(x)
        return qp.eager.convert(prepared)

    x = _input_for(_conv_bn_model(wrap))
    model = make(wrap)
    oracle = make(lambda m: m)
    with torch.no_grad():
        model(x)
        oracle[1].weight.copy_(model[1].weight)
        assert torch.equal(eager_int8(model)(x), eager_int8(oracle)(x))


@pytest.mark.parametrize("wrap, originals", [
    (parametrizations.weight_norm, ("original0", "original1")),
    (nn.utils.weight_norm, ("original0", "original1")),
    (parametrizations.spectral_norm, ("original",)),
    (nn.utils.spectral_norm, ("original",))], ids=["parametrizations weight_norm", "hook weight_norm",
                                                    "parametrizations spectral_norm", "hook spectral_norm"])
def test_qat_trains_what_the_weight_is_computed_from_and_converts_it(wrap, originals):
    """QAT keeps the parametrization (weight_norm's g and v train; a hook becomes the equivalent
    parametrization, deepcopy refused it); convert materialises the trained weight."""
    model = _linear_model(wrap)
    x = _input_for(model)
    with torch.no_grad():
        model(x)  # a hook computes the weight at the call
        float_weight = model[0].weight.clone()
    observed = qp.prepare_qat_fx(model, qp.get_default_qconfig_mapping("fbgemm", mode="qat"), (x,),
                                 backend="fbgemm")
    observed.eval()
    with torch.no_grad():
        torch.testing.assert_close(observed.get_submodule("0").weight, float_weight, rtol=0, atol=1e-6)
    observed.train()
    names = [f"0.parametrizations.weight.{name}" for name in originals]
    trained = dict(observed.named_parameters())
    start = {name: trained[name].detach().clone() for name in names}
    optimizer = torch.optim.SGD(observed.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        observed(x).pow(2).sum().backward()
        optimizer.step()
    assert all(not torch.equal(trained[name], start[name]) for name in names)
    observed.eval()
    with torch.no_grad():
        assert torch.equal(qp.convert_to_reference_fx(observed)(x), qp.convert_fx(observed)(x))


def test_qat_of_a_hook_spectral_norm_on_a_1d_weight_names_the_layer():
    """parametrizations.spectral_norm normalises a 1-D tensor otherwise than the hook did."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.utils.spectral_norm(nn.LayerNorm(16))).train()
    with pytest.raises(ModelStateError, match=r"layer '1': its hook-based spectral_norm normalises a 1-D "
                                              r"'weight'.*parametrizations\.spectral_norm"):
        qp.prepare_qat_fx(model, qp.get_default_qconfig_mapping("fbgemm", mode="qat"),
                          (torch.randn(4, 16),), backend="fbgemm")
