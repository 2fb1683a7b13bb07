"""Bias correction removes the mean output shift int8 weights cause, on the calibration data."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core import qparams as Q
from qplug_core.algorithms import correct_bias
from qplug_core.config.defaults import default_qconfig_mapping
from qplug_core.errors import CalibrationError, ConfigValidationError
from qplug_core.flows import tags
from qplug_core.kernels.reference import observed_weight_qparams


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8, 5)
        with torch.no_grad():
            self.dw.weight.mul_(torch.logspace(-2, 1, 8).view(8, 1, 1, 1))

    def forward(self, x):
        y = torch.relu(self.dw(self.conv(x)))
        return self.fc(y.mean((2, 3)))


def _layer(gm, name: str) -> nn.Module:
    """The weighted layer at ``name``: the conv inside a fused conv + relu (torch.relu fuses too)."""
    module = gm.get_submodule(name)
    return module[0] if isinstance(module, nn.Sequential) else module


def _weight_quantized(layer: nn.Module, mapping) -> nn.Module:
    """The layer with its weight on the int8 grid the mapping's weight observer gives."""
    qconfig = mapping.qconfig_for_module("", type(layer))
    out = copy.deepcopy(layer)
    with torch.no_grad():
        out.weight.copy_(Q.fake_quantize(out.weight, observed_weight_qparams(qconfig, out.weight)))
    return out


def _inputs_of(gm, name, data):
    seen = []
    handle = gm.get_submodule(name).register_forward_hook(lambda m, a, o: seen.append(a[0]))
    with torch.no_grad():
        for (x,) in data:
            gm(x)
    handle.remove()
    return seen


@pytest.mark.parametrize("per_channel", [False, True])
def test_each_layer_keeps_its_float_mean_output_on_the_calibration_set(per_channel):
    torch.manual_seed(0)
    mapping = default_qconfig_mapping("static", per_channel=per_channel)
    data = [(torch.randn(4, 3, 6, 6) + 0.5,) for _ in range(3)]
    gm = qp.fuse_fx(_Net().eval(), data[0], backend="reference")
    float_gm = copy.deepcopy(gm)
    corrections = correct_bias(gm, data, qconfig_mapping=mapping, significance=0)
    assert {c.layer for c in corrections} == {"conv", "dw", "fc"}
    assert _layer(gm, "conv").bias is not None  # a bias-free layer got one
    for name, dims in (("conv", (0, 2, 3)), ("dw", (0, 2, 3)), ("fc", (0,))):
        inputs = _inputs_of(float_gm, name, data)
        reference = _layer(float_gm, name)
        uncorrected = _weight_quantized(reference, mapping)
        corrected = _weight_quantized(_layer(gm, name), mapping)
        with torch.no_grad():
            want = torch.cat([reference(x) for x in inputs]).mean(dims)
            before = torch.cat([uncorrected(x) for x in inputs]).mean(dims)
            after = torch.cat([corrected(x) for x in inputs]).mean(dims)
        assert float((after - want).abs().max()) < 1e-5 * float(want.abs().max()) + 1e-6
        if name == "dw" and not per_channel:  # per-tensor depthwise: a real shift was removed
            assert float((before - want).abs().max()) > 100 * float((after - want).abs().max())


def _linear_with_rounding_shift() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(64, 16).eval()


def _held_out_error(layer: nn.Module, corrected: nn.Module, mapping, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float((_weight_quantized(corrected, mapping)(x) - layer(x)).square().mean())


def test_a_shift_within_the_noise_of_zero_mean_inputs_is_left_alone():
    # zero-mean inputs: E x has mean 0, and its sample mean over a few rows is noise; subtracting
    # it would add a constant error to every held-out output (significance=0 does, for contrast)
    mapping = default_qconfig_mapping("static")
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 64, generator=g) * scale,) for scale in (1, 300, 1, 300)]
    held_out = torch.randn(256, 64, generator=g)
    layer = _linear_with_rounding_shift()
    guarded, unguarded = (qp.fuse_fx(nn.Sequential(copy.deepcopy(layer)), data[0], backend="reference")
                          for _ in range(2))
    assert correct_bias(guarded, data, qconfig_mapping=mapping) == []
    assert torch.equal(guarded.get_submodule("0").bias, layer.bias)
    correct_bias(unguarded, data, qconfig_mapping=mapping, significance=0)
    assert (_held_out_error(layer, unguarded.get_submodule("0"), mapping, held_out)
            > 10 * _held_out_error(layer, layer, mapping, held_out))


def test_a_shift_the_data_shows_is_corrected_by_default():
    # post-ReLU inputs (mean > 0): the rounding error's mean shift is real and held-out data has it
    mapping = default_qconfig_mapping("static")
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 64, generator=g).relu(),) for _ in range(4)]
    held_out = torch.randn(256, 64, generator=g).relu()
    layer = _linear_with_rounding_shift()
    gm = qp.fuse_fx(nn.Sequential(copy.deepcopy(layer)), data[0], backend="reference")
    (correction,) = correct_bias(gm, data, qconfig_mapping=mapping)
    assert correction.channels >= 12
    assert (_held_out_error(layer, gm.get_submodule("0"), mapping, held_out)
            < 0.8 * _held_out_error(layer, layer, mapping, held_out))


def test_weights_and_the_float_model_are_untouched():
    data = [(torch.randn(2, 3, 6, 6),)]
    model = _Net().eval()
    gm = qp.fuse_fx(model, data[0], backend="reference")
    weights = {n: p.clone() for n, p in gm.named_parameters() if n.endswith("weight")}
    correct_bias(gm, data, qconfig_mapping=default_qconfig_mapping("static"))
    for name, weight in weights.items():
        assert torch.equal(gm.get_parameter(name), weight)
    assert model.conv.bias is None


def test_bad_arguments_are_clear_errors():
    gm = qp.fuse_fx(_Net().eval(), (torch.randn(1, 3, 6, 6),), backend="reference")
    with pytest.raises(CalibrationError, match="0 calibration batches"):
        correct_bias(gm, [], qconfig_mapping=default_qconfig_mapping("static"))
    with pytest.raises(ConfigValidationError, match="QConfigMapping"):
        correct_bias(gm, [(torch.randn(1, 3, 6, 6),)], qconfig_mapping=None)


class _Conv1dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, padding=2, stride=2, dilation=2)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(2))


@pytest.mark.parametrize("net, shape, names", [
    (_Net, (4, 3, 6, 6), ("conv", "dw", "fc")), (_Conv1dNet, (4, 4, 9), ("conv", "fc"))])
def test_convert_corrects_for_the_grid_it_gives_the_layer(net, shape, names):
    """Corrected for 7-bit weights, then given 8-bit ones (convert's per-layer choice on CPUs
    without VNNI): the bias is that of a correction made for the 8-bit grid in the first place,
    so each layer again has its float mean output on the calibration set (every channel
    corrected: the significance guard's mask is the first grid's, kept through regrid)."""
    from qplug_core.flows import bias_grid

    torch.manual_seed(0)
    seven = default_qconfig_mapping("static", per_channel=True, weight_quant_min=-64, weight_quant_max=64)
    eight = default_qconfig_mapping("static", per_channel=True)
    data = [(torch.randn(*shape) + 0.5,) for _ in range(3)]
    gm = qp.fuse_fx(net().eval(), data[0], backend="reference")
    float_gm, direct = copy.deepcopy(gm), copy.deepcopy(gm)
    correct_bias(gm, data, qconfig_mapping=seven, significance=0)
    correct_bias(direct, data, qconfig_mapping=eight, significance=0)
    for name in names:
        layer = _layer(gm, name)
        before = layer.bias.detach().clone()
        qconfig = eight.qconfig_for_module("", type(layer))
        bias_grid.regrid(layer, observed_weight_qparams(qconfig, layer.weight))
        want = _layer(direct, name).bias.detach()
        assert torch.allclose(layer.bias.detach(), want, rtol=1e-5, atol=1e-6), name
        assert not torch.allclose(before, want, rtol=1e-5, atol=1e-6), name  # the grids differ
        bias_grid.regrid(layer, observed_weight_qparams(qconfig, layer.weight))  # idempotent
        assert torch.allclose(layer.bias.detach(), want, rtol=1e-5, atol=1e-6), name
    for name in names:  # and back to 7 bits: the 7-bit correction again
        layer = _layer(gm, name)
        bias_grid.regrid(layer, observed_weight_qparams(seven.qconfig_for_module("", type(layer)),
                                                        layer.weight))
    again = copy.deepcopy(float_gm)
    correct_bias(again, data, qconfig_mapping=seven, significance=0)
    for name in names:
        assert torch.allclose(_layer(gm, name).bias.detach(), _layer(again, name).bias.detach(),
                              rtol=1e-5, atol=1e-6), name


def test_a_layer_convert_leaves_float_gets_its_float_bias_back_exactly():
    """An accuracy target may take a corrected layer out of int8 (float): its bias must be the
    float model's again, bit for bit, not the one corrected for int8 weights it no longer has."""
    torch.manual_seed(0)
    data = [(torch.randn(4, 3, 6, 6) + 0.5,) for _ in range(3)]
    gm = qp.fuse_fx(_Net().eval(), data[0], backend="reference")
    original = {n: _layer(gm, n).bias.detach().clone() for n in ("dw", "fc")}
    mapping = default_qconfig_mapping("static", per_channel=True)
    corrections = {c.layer: c.max_shift for c in correct_bias(gm, data, qconfig_mapping=mapping)}
    assert corrections["dw"] > 0 and corrections["fc"] > 0
    observed = qp.prepare_fx(gm, mapping.set_module_name("dw", None), data[0], backend="reference")
    qp.calibrate(observed, data)
    qmodel = qp.convert_fx(observed)
    dw = _layer(qmodel, "dw")
    assert isinstance(dw, nn.Conv2d) and not hasattr(qmodel.get_submodule("dw"), "weight_qparams")  # float
    assert torch.equal(dw.bias.detach(), original["dw"])  # the float bias again
    fc = qmodel.get_submodule("fc").module
    assert not torch.allclose(fc.bias.detach(), original["fc"])  # still int8: still corrected


def test_a_target_that_takes_a_corrected_layer_to_float_gives_it_the_float_bias():
    """recipe="bias_correction" with a target: fc1 (its input has a 1000x channel) goes float,
    and runs with its float bias (it ran 0.22 off). The search reuses the observers calibrated on
    the corrected model, so the grid after fc1 is not bit-for-bit a fresh calibration's."""
    from qplug_core.flows.tags import TARGET

    class OutlierInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)
            with torch.no_grad():
                self.fc1.weight[:, 0] *= 1e-3

        def forward(self, x):
            x = torch.relu(x) + 0.5  # inputs with a mean: a shift bias correction measures
            x = x * torch.cat([torch.full((1,), 1000.0), torch.ones(15)])
            return self.fc2(torch.relu(self.fc1(x)))

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g),) for _ in range(4)]
    qmodel = qp.quantize(OutlierInput().eval(), data[0], data, backend="reference",
                         recipe="bias_correction", target=qp.Target(sqnr=15, fallback="float", group="layer"))
    result = qmodel.meta[TARGET]
    assert result.met and result.float_layers == ["fc1"]
    shifts = {c.layer: c.max_shift for c in qmodel.meta["qplug_recipe"].results["bias_correction"]}
    assert shifts["fc1"] > 0  # corrected before the search took it out
    fc1 = qmodel.get_submodule("fc1")[0]  # LinearReLU, float
    assert torch.equal(fc1.bias.detach(), OutlierInput().fc1.bias.detach())
    mapping = qp.get_default_qconfig_mapping("reference").set_module_name("fc1", None)
    fresh = qp.quantize(OutlierInput().eval(), data[0], data, backend="reference",
                        qconfig_mapping=mapping, recipe="bias_correction")
    with torch.no_grad():
        assert qp.sqnr(fresh(*data[0]), qmodel(*data[0])) > 30  # one step of the grid apart


def test_qp_quantize_corrects_biases_while_calibrating_and_leaves_the_users_model_alone():
    """The default on a model that is not a transformer: the shifts are measured on the observed
    copy during calibration and removed there, for the grid convert gives each layer."""
    from qplug_core.flows.snapshot import snapshot_of

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(),
                          nn.Linear(8 * 4 * 4, 4)).eval()
    before = copy.deepcopy(model.state_dict())
    data = [(torch.randn(4, 3, 8, 8).relu(),) for _ in range(4)]
    qmodel = qp.quantize(model, data[0], data, backend="reference")
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in before.items())
    record = qmodel.meta["qplug_recipe"]
    assert record.name == "auto: bias_correction"
    assert {c.layer for c in record.results["bias_correction"]} == {"0", "2", "4"}
    reference = snapshot_of(qmodel).graph_module
    for name in ("0", "2", "4"):
        converted = reference.get_submodule(name)
        layer = next(m for m in converted.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
        correction = getattr(layer, tags.BIAS_CORRECTION)
        assert torch.equal(correction.original, getattr(model, name).bias.detach())
        assert torch.allclose(layer.bias.detach(), correction.original - correction.removed)
        assert float(correction.removed.abs().max()) > 0
    plain = qp.quantize(model, data[0], data, backend="reference", recipe="none")
    assert "qplug_recipe" not in plain.meta


@pytest.mark.parametrize("layer, shape", [
    (nn.Conv2d(3, 5, 3, padding=1), (4, 3, 9, 9)),
    (nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(2, 0), dilation=(1, 2)), (2, 4, 11, 10)),
    (nn.Conv2d(3, 8, 7, stride=2, padding=3), (2, 3, 32, 32)),
    (nn.Conv2d(8, 8, 3, padding=1, groups=8), (3, 8, 6, 6)),
    (nn.Conv2d(3, 4, 3), (3, 7, 7)),  # unbatched
], ids=["3x3", "strided-dilated", "7x7-stem", "depthwise", "unbatched"])
def test_gemm_column_sums_are_those_of_im2col(layer, shape):
    import torch.nn.functional as F

    from qplug_core.flows import bias_grid

    x = torch.randn(*shape)
    total, rows = bias_grid.columns(layer, x)
    unfolded = F.unfold(x if x.dim() == 4 else x.unsqueeze(0), layer.kernel_size, dilation=layer.dilation,
                        padding=layer.padding, stride=layer.stride).double()
    assert torch.allclose(total, unfolded.sum((0, 2)), rtol=1e-12, atol=1e-9)
    assert rows == unfolded.shape[0] * unfolded.shape[2]
