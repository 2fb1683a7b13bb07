"""The numeric comparison report: SQNR maths, per-layer pairing, safety, rendering, JSON."""

from __future__ import annotations

import copy
import io
import json
import math
import warnings

import pytest
import torch
from rich.console import Console
from torch import nn

from qplug_core.analysis.compare import compare
from qplug_core.analysis.layers import ComparisonReport, sqnr
from qplug_core.errors import ConfigError, InputMismatchError
from qplug_core.zoo import example_inputs, get_model
from qplug_core.zoo.resnet import BasicBlock

pytestmark = pytest.mark.usefixtures("one_thread")


def noisy(reference: torch.Tensor, ratio: float, seed: int = 0) -> torch.Tensor:
    """``reference`` plus noise whose L2 norm is exactly ``||reference|| / ratio``."""
    noise = torch.randn(reference.shape, generator=torch.Generator().manual_seed(seed),
                        dtype=torch.float64)
    return (reference.double() + noise * reference.double().norm() / (ratio * noise.norm()))


def perturbed(model: nn.Module, scale: float = 1e-2, only: str | None = None) -> nn.Module:
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if only is None or name.startswith(only):
                p.add_(torch.randn(p.shape, generator=gen) * scale * p.abs().mean())
    return twin


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def no_hooks(model: nn.Module) -> bool:
    return not any(m._forward_hooks for m in model.modules())


# -- sqnr ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio, expected_db", [(10.0, 20.0), (100.0, 40.0), (1.0, 0.0)])
def test_sqnr_of_known_noise_ratio(ratio, expected_db):
    ref = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    assert sqnr(ref, noisy(ref, ratio)) == pytest.approx(expected_db, abs=1e-6)


def test_sqnr_edge_cases():
    x = torch.randn(10)
    assert sqnr(x, x.clone()) == math.inf
    assert sqnr(torch.zeros(3), torch.zeros(3)) == math.inf
    assert sqnr(torch.zeros(3), torch.ones(3)) == -math.inf
    assert math.isnan(sqnr(torch.tensor([1.0, math.nan]), torch.ones(2)))
    with pytest.raises(ConfigError, match=r"shapes differ.*\(3,\).*\(4,\)"):
        sqnr(torch.ones(3), torch.ones(4))


def test_sqnr_dequantizes_torch_quantized_tensors():
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():  # creating a quantized tensor warns in torch >= 2.13
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(x, 0.05, 0, torch.qint8)
    value = sqnr(x, q)
    assert value == sqnr(x, q.dequantize())
    assert 25 < value < 60


# -- compare: numbers ------------------------------------------------------------------------------


def test_compare_identical_models_is_exact():
    model = get_model("digits_cnn", seed=0)
    report = compare(model, copy.deepcopy(model), example_inputs("digits_cnn", batch=4))
    assert report.output_sqnr_db == math.inf and report.output_cosine == pytest.approx(1.0)
    assert report.output_max_abs_err == 0.0
    assert [layer.name for layer in report.layers] == [
        "conv1", "bn1", "relu1", "conv2", "bn2", "relu2", "pool", "conv3", "bn3", "relu3", "fc"]
    assert all(layer.sqnr_db == math.inf and layer.rel_l2_err == 0.0 for layer in report.layers)


def test_compare_scaled_output_has_known_sqnr():
    model = nn.Sequential(nn.Linear(6, 4, bias=False))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.mul_(1.1)  # output = 1.1 * reference -> error is 10% of the signal
    x = torch.randn(5, 6)
    report = compare(model, twin, (x,))
    assert report.output_sqnr_db == pytest.approx(20.0, abs=1e-4)
    assert report.output_cosine == pytest.approx(1.0)
    (layer,) = report.layers
    assert (layer.name, layer.float_type, layer.quant_type) == ("0", "Linear", "Linear")
    assert layer.sqnr_db == pytest.approx(20.0, abs=1e-4)
    assert layer.rel_l2_err == pytest.approx(0.1, rel=1e-4)
    with torch.no_grad():
        expected_max = float((0.1 * model(x)).abs().max())
    assert layer.max_abs_err == pytest.approx(expected_max, rel=1e-4)


def test_compare_locates_the_perturbed_layer():
    model = get_model("digits_cnn", seed=0)
    report = compare(model, perturbed(model, only="fc."), example_inputs("digits_cnn", batch=8))
    by_name = {layer.name: layer for layer in report.layers}
    assert all(by_name[n].sqnr_db == math.inf for n in ("conv1", "bn2", "relu3"))
    assert math.isfinite(by_name["fc"].sqnr_db)
    assert report.worst(1)[0].name == "fc"
    assert by_name["fc"].sqnr_db == pytest.approx(report.output_sqnr_db)


def test_compare_accumulates_over_batches():
    model = get_model("digits_cnn", seed=0)
    twin = perturbed(model)
    batches = [example_inputs("digits_cnn", batch=3, seed=s) for s in range(3)]
    report = compare(model, twin, batches)
    assert report.num_batches == 3
    (x_all,) = (torch.cat([b[0] for b in batches]),)
    with torch.no_grad():
        expected = sqnr(model(x_all), twin(x_all))
    assert report.output_sqnr_db == pytest.approx(expected, abs=1e-6)
    assert report.layers[0].num_outputs == 3
    assert compare(model, twin, x_all).num_batches == 1  # a bare tensor is one batch
    assert compare(model, twin, (b for b in batches)).num_batches == 3


def test_compare_records_outputs_before_in_place_ops():
    """torchvision's BasicBlock adds into bn2's output and runs ReLU(inplace=True) on it."""
    torch.manual_seed(0)
    block = BasicBlock(8, 8).eval()
    twin = perturbed(block, scale=0.05)
    x = torch.randn(2, 8, 6, 6)
    report = compare(block, twin, (x,))
    with torch.no_grad():
        def bn2_out(b: BasicBlock) -> torch.Tensor:
            return b.bn2(b.conv2(b.relu(b.bn1(b.conv1(x)))))
        expected = sqnr(bn2_out(block), bn2_out(twin))
    bn2 = next(layer for layer in report.layers if layer.name == "bn2")
    assert bn2.sqnr_db == pytest.approx(expected, abs=1e-6)
    relu = next(layer for layer in report.layers if layer.name == "relu")
    assert relu.num_outputs == 2  # the shared ReLU is paired call by call


def test_compare_handles_tuple_outputs_of_recurrent_layers():
    model = get_model("lstm_classifier", seed=0)
    inputs = example_inputs("lstm_classifier", batch=2)
    report = compare(model, perturbed(model), inputs)
    rnn = next(layer for layer in report.layers if layer.name == "rnn")
    assert rnn.shape == (2, 8, 64) and math.isfinite(rnn.sqnr_db)


# -- compare: pairing ------------------------------------------------------------------------------


def test_compare_against_graph_module_and_fused_away_modules():
    model = get_model("digits_cnn", seed=0)
    gm = torch.fx.symbolic_trace(copy.deepcopy(model))
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "relu1":
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.delete_all_unused_submodules()
    gm.recompile()
    report = compare(model, gm, example_inputs("digits_cnn", batch=2))
    assert report.float_only == ["relu1"]
    assert "relu1" not in {layer.name for layer in report.layers}
    assert report.layers[0].name == "conv1" and report.layers[0].sqnr_db == math.inf


def test_compare_skips_modules_the_quantized_model_never_runs():
    model = get_model("resnet18", seed=0, num_classes=10)
    gm = torch.fx.symbolic_trace(copy.deepcopy(model))
    report = compare(model, gm, torch.randn(1, 3, 32, 32), layers=["layer1.0", "layer1.0.conv1"])
    assert report.skipped == {"layer1.0": "not run by the quantized model"}
    assert [layer.name for layer in report.layers] == ["layer1.0.conv1"]


def test_compare_layers_argument_is_validated():
    model = get_model("digits_cnn", seed=0)
    x = example_inputs("digits_cnn")
    assert [layer.name for layer in compare(model, model, x, layers="fc").layers] == ["fc"]
    with pytest.raises(ConfigError, match="did you mean 'conv2'") as info:
        compare(model, model, x, layers=["conv_2"])
    assert info.value.field == "layers"


@pytest.mark.parametrize("inputs, message", [(42, "iterable"), ([], "no input batches")])
def test_compare_rejects_bad_inputs(inputs, message):
    model = get_model("digits_cnn", seed=0)
    with pytest.raises(ConfigError, match=message):
        compare(model, model, inputs)


# -- compare: models are left alone --------------------------------------------------------------


def test_compare_does_not_modify_models():
    model = get_model("digits_cnn", seed=0, train=True)
    twin = perturbed(model)
    before, twin_before = state(model), state(twin)
    compare(model, twin, example_inputs("digits_cnn", batch=4))
    for k, v in model.state_dict().items():  # BN running stats untouched: ran in eval mode
        assert torch.equal(v, before[k]), k
    assert all(torch.equal(v, twin_before[k]) for k, v in twin.state_dict().items())
    assert all(m.training for m in model.modules()) and all(m.training for m in twin.modules())
    assert no_hooks(model) and no_hooks(twin)


def test_compare_removes_hooks_when_a_model_fails():
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("kernel exploded")

    model, broken = nn.Sequential(), Broken()
    model.add_module("fc", nn.Linear(4, 2))
    with pytest.raises(InputMismatchError, match="the quantized model raised on batch 0: RuntimeError: "
                                                 "kernel exploded") as raised:
        compare(model, broken, (torch.randn(1, 4),))
    assert isinstance(raised.value.__cause__, RuntimeError)  # the model's own error, chained
    assert no_hooks(model) and no_hooks(broken)


# -- output ----------------------------------------------------------------------------------------


def test_to_dict_is_strict_json():
    model = get_model("digits_cnn", seed=0)
    report = compare(model, perturbed(model, only="fc."), example_inputs("digits_cnn", batch=2))
    doc = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert doc["schema_version"] == 1 and doc["num_batches"] == 1
    assert doc["layers"][0]["sqnr_db"] == "inf" and float(doc["layers"][0]["sqnr_db"]) == math.inf
    assert doc["layers"][-1]["name"] == "fc" and isinstance(doc["layers"][-1]["sqnr_db"], float)
    assert doc["layers"][0]["shape"] == [2, 16, 8, 8]


def test_rendering_shows_layers_and_summary():
    model = get_model("resnet18", seed=0, num_classes=10)
    gm = torch.fx.symbolic_trace(perturbed(model))
    report = compare(model, gm, torch.randn(1, 3, 32, 32))
    console = Console(file=io.StringIO(), width=120, record=True)
    report.print(console)
    text = console.export_text()
    assert "layer2.0.downsample.0" in text and "Conv2d" in text
    assert "BasicBlock" not in text  # blocks are inlined by tracing, so they are skipped
    assert "output: SQNR" in text and "not compared" in text
    worst = report.worst(5)
    assert len(worst) == 5 and worst == sorted(worst, key=lambda layer: layer.sqnr_db)


def test_rendering_survives_non_finite_values():
    report = ComparisonReport(layers=[], output_sqnr_db=math.nan, output_cosine=0.0,
                              output_max_abs_err=math.inf, num_batches=1)
    console = Console(file=io.StringIO(), width=80, record=True)
    report.print(console)
    assert "nan dB" in console.export_text()
    assert json.dumps(report.to_dict(), allow_nan=False)


def test_a_kernel_computing_a_fused_module_is_named_after_it(plugin_autoload):
    """The fbgemm conv kernel of ConvReLU2d (ReLU in its output range) is shown as ConvReLU2d."""
    import qplug_core as qp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 1)).eval()
    data = [(torch.randn(2, 3, 6, 6),)]
    qmodel = qp.quantize(model, data[0], data, backend="fbgemm", progress=False)
    report = qp.compare(qp.fuse_fx(model, data[0], backend="fbgemm"), qmodel, data)
    types = {layer.name: (layer.float_type, layer.quant_type) for layer in report.layers}
    assert types["0"] == ("ConvReLU2d", "ConvReLU2d") and types["2"] == ("Conv2d", "Conv2d")


def test_print_shows_the_table_not_the_fields():
    model = nn.Sequential(nn.Linear(6, 4))
    text = str(compare(model, copy.deepcopy(model), (torch.randn(3, 6),)))
    assert text.startswith("quantized vs float, per layer") and "LayerComparison(" not in text
    assert all(len(line) <= 80 for line in text.splitlines())


class _ConvClampNet(nn.Module):
    """Conv-BN-act twice (MobileNet's block shape); ``act`` None: ``torch.clamp(x, 0, 6)`` as a call."""

    def __init__(self, act: type[nn.Module] | None) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.act1, self.act2 = (act(), act()) if act is not None else (nn.Identity(), nn.Identity())
        self.functional = act is None
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, bn, act in ((self.conv1, self.bn1, self.act1), (self.conv2, self.bn2, self.act2)):
            x = bn(conv(x))
            x = torch.clamp(x, 0, 6) if self.functional else act(x)
        return self.head(x.mean((2, 3)))


def _conv_rows(act: type[nn.Module] | None, backend: str = "fbgemm"
               ) -> tuple[ComparisonReport, dict[str, tuple[str, float]]]:
    import qplug_core as qp

    torch.manual_seed(0)
    model = _ConvClampNet(act).eval()
    data = [(torch.randn(4, 3, 12, 12),) for _ in range(4)]
    qmodel = qp.quantize(model, data[0], data, backend=backend, progress=False)
    report = qp.compare(qp.fuse_fx(model, data[0], backend=backend), qmodel, data)
    return report, {layer.name: (layer.float_type, layer.sqnr_db) for layer in report.layers
                    if layer.name.startswith("conv")}


@pytest.mark.parametrize("act, float_type", [(nn.ReLU6, "Conv2d+ReLU6"), (None, "Conv2d+clamp")])
def test_a_layer_that_absorbed_a_clamp_is_paired_with_the_clamped_float_value(plugin_autoload, act, float_type):
    """Convert drops the ReLU6 after a conv (the conv's int8 range holds it): the conv's row compares
    the float value after the ReLU6, as the ReLU model's fused ConvReLU2d row does (it read 2-3 dB)."""
    report, rows = _conv_rows(act)
    _, relu_rows = _conv_rows(nn.ReLU)
    assert report.output_sqnr_db > 40
    assert set(rows) == {"conv1", "conv2"} and not report.float_only
    for name, (kind, db) in rows.items():
        assert kind == float_type and report.output_sqnr_db - 12 < db and db > 30
        assert relu_rows[name][0] == "ConvReLU2d" and db == pytest.approx(relu_rows[name][1], abs=1.0)


def test_a_reference_form_layer_is_paired_with_the_float_value_before_the_absorbed_clamp():
    """In reference form the conv outputs float, and the Quantize after it clamps: the conv's row
    compares it with the float conv as it is (against the float ReLU6 it read -0.3 dB)."""
    report, rows = _conv_rows(nn.ReLU6, backend="reference")
    assert set(rows) == {"conv1", "conv2"} and not report.float_only
    for kind, db in rows.values():
        assert kind == "Conv2d" and db > 30


def test_an_exported_models_relu6_module_is_named_as_the_absorbed_clamp(plugin_autoload):
    """torch.export's graph calls ``hardtanh`` for the ReLU6 module ``1``: the conv's row still reads
    Conv2d+ReLU6, and ``1`` is no float module absent from the int8 model (the report listed it)."""
    import qplug_core as qp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU6(), nn.Conv2d(8, 4, 1)).eval()
    data = [(torch.randn(2, 3, 8, 8) * 2,)]
    qmodel = qp.quantize(model, data[0], data, backend="fbgemm", progress=False, capture="export")
    report = qp.compare(model, qmodel, data)
    assert [(layer.name, layer.float_type) for layer in report.layers] == [("0", "Conv2d+ReLU6"), ("2", "Conv2d")]
    assert not report.float_only and report.layers[0].sqnr_db > 30
