"""capture="auto"|"symbolic"|"export" (issue 13): exported graphs quantize like traced ones.

The export path raises ATen ops to the modules and functionals the pattern set names, so a model
that traces both ways must give the *same* int8 model both ways; a model with Python control flow
on shapes quantizes through export by default; nothing quantized is an error, not a float model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError, NothingQuantizedError, TraceError

pytestmark = [pytest.mark.usefixtures("plugin_autoload"), pytest.mark.slow]  # ~25 s: export


class ConvBnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.drop = nn.Dropout(0.1)
        self.skip = nn.Identity()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.conv2(y) + self.skip(y))
        return self.fc(self.drop(y.mean((2, 3))))


class ShapeGatedNet(nn.Module):
    """An ``if`` on the input's shape between two int8 convs: symbolic tracing cannot take it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv1(x))
        if y.shape[-1] > 8:
            y = nn.functional.max_pool2d(y, 2)
        return self.conv2(y)


def _data(seed: int, shape=(2, 3, 16, 16)) -> tuple[torch.Tensor]:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)),)


def _model(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    model = cls().eval()
    if isinstance(model, ConvBnNet):
        model.bn1.running_mean.uniform_(-0.2, 0.2)
        model.bn1.running_var.uniform_(0.5, 2.0)
    return model


def _quantize(model, **options):
    return qp.quantize(model, _data(0), [_data(s) for s in range(1, 4)], backend="fbgemm", **options)


def test_export_gives_the_same_int8_model_as_symbolic_tracing():
    model = _model(ConvBnNet)
    symbolic = _quantize(model, capture="symbolic")
    exported = _quantize(model, capture="export")
    r_sym, r_exp = qp.quantization_report(symbolic), qp.quantization_report(exported)
    assert (r_sym.capture, r_exp.capture) == ("symbolic", "export")
    # the same modules, fused and lowered to the same kernels, under the user's module names
    fused = {f.module_name: f.fused_type for f in r_exp.fusions}
    assert fused == {f.module_name: f.fused_type for f in r_sym.fusions}
    assert fused["conv1"] == "ConvReLU2d"  # batch norm folded in
    assert sorted(r_exp.kernels.values()) == sorted(r_sym.kernels.values())
    for x in (_data(7), _data(8)):
        assert torch.equal(exported(*x), symbolic(*x))


def test_dropout_and_identity_are_removed_not_reported():
    quantized = _quantize(_model(ConvBnNet), capture="symbolic")
    skipped = {s.op for s in qp.quantization_report(quantized).skipped}
    assert not skipped & {"Dropout", "Identity"}
    assert not any(isinstance(m, (nn.Dropout, nn.Identity)) for m in quantized.modules())


def test_shape_dependent_control_flow_between_convs_quantizes_by_default():
    model = _model(ShapeGatedNet)
    quantized = _quantize(model)
    report = qp.quantization_report(quantized)
    assert report.capture == "export"
    assert {"conv1", "conv2"} <= {n.target for n in quantized.graph.nodes
                                  if n.op == "call_module" and n.meta.get("qplug_kernel")}
    x = _data(9)
    assert qp.sqnr(model(*x), quantized(*x)) > 25


def test_symbolic_capture_says_it_cannot_trace_and_export_is_the_way_out():
    with pytest.raises(TraceError, match="cannot trace the top-level forward of ShapeGatedNet"):
        _quantize(_model(ShapeGatedNet), capture="symbolic")


@pytest.mark.parametrize("form", ["program", "module"])
def test_exported_program_and_its_module_are_accepted(form):
    model = _model(ConvBnNet)
    program = torch.export.export(model, _data(0))
    given = program if form == "program" else program.module()
    quantized = _quantize(given)
    assert qp.quantization_report(quantized).capture == "export"
    reference = _quantize(model, capture="symbolic")
    assert torch.equal(quantized(*_data(5)), reference(*_data(5)))


def test_unknown_capture_level_is_refused():
    with pytest.raises(ConfigValidationError, match=r"capture must be one of \('auto', 'symbolic', 'export'\)"):
        _quantize(_model(ConvBnNet), capture="dynamo")


class NothingToQuantize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x).cumsum(-1)


def test_nothing_quantized_is_an_error_naming_the_reasons():
    with pytest.raises(NothingQuantizedError, match=r"nothing was quantized: 0 int8 regions \(symbolic "
                                                    r"capture.*no quantization pattern of the backend "
                                                    r"matches this op \(2 op\(s\)\).*allow_float=True") as raised:
        _quantize(NothingToQuantize())
    assert raised.value.reasons == [("no quantization pattern of the backend matches this op", 2)]
    result = _quantize(NothingToQuantize(), allow_float=True)
    assert qp.quantization_report(result).quantized == {}
    assert torch.allclose(result(*_data(3)), NothingToQuantize()(*_data(3)))


class TokenEncoder(nn.Module):
    """Token ids and an attention mask of any length (calibration batches are padded each to its
    own longest sentence), as a text model is called."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 16)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.fc2(torch.relu(self.fc1(self.embedding(input_ids))))
        return hidden * attention_mask.unsqueeze(-1).to(hidden.dtype)


def _tokens(batch: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (batch, length), generator=g), torch.ones(batch, length, dtype=torch.int64)


def test_export_takes_token_batches_of_other_lengths_than_the_example():
    model = TokenEncoder().eval()
    calibration = [_tokens(2, length, seed) for seed, length in enumerate((5, 7, 6))]
    qmodel = qp.quantize(model, calibration[0], calibration, backend="fbgemm", capture="export",
                         recipe="none")
    ids, mask = _tokens(3, 11, 9)
    with torch.no_grad():
        got, want = qmodel(ids, mask), model(ids, mask)
    assert got.shape == (3, 11, 16)
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99


def test_prelu_is_an_int8_region_at_the_export_level_too():
    # torch.export gives aten.prelu; the shared patterns have nn.PReLU only: capture raises it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.PReLU(4), nn.Conv2d(4, 4, 1)).eval()
    data = [(torch.randn(1, 3, 8, 8),) for _ in range(3)]
    levels = {capture: qp.quantize(model, data[0], data, backend="reference", capture=capture)
              for capture in ("symbolic", "export")}
    quantized = {c: qp.quantization_report(m).quantized for c, m in levels.items()}
    assert quantized["export"] == quantized["symbolic"] == {"0": "Conv2d", "1": "PReLU", "2": "Conv2d"}
    with torch.no_grad():
        torch.testing.assert_close(levels["export"](*data[1]), levels["symbolic"](*data[1]))


class _FrozenBatchNorm2d(nn.Module):
    """DETR's (and torchvision's) BatchNorm with fixed statistics: ``x * scale + shift`` of buffers."""

    def __init__(self, channels: int):
        super().__init__()
        self.register_buffer("weight", torch.rand(channels) + 0.5)
        self.register_buffer("bias", torch.randn(channels))
        self.register_buffer("running_mean", torch.randn(channels))
        self.register_buffer("running_var", torch.rand(channels) + 0.5)

    def forward(self, x):
        scale = self.weight.reshape(1, -1, 1, 1) * (self.running_var.reshape(1, -1, 1, 1) + 1e-5).rsqrt()
        return x * scale + (self.bias.reshape(1, -1, 1, 1) - self.running_mean.reshape(1, -1, 1, 1) * scale)


def test_a_frozen_batch_norm_after_a_conv_folds_into_it():
    """Exported, a frozen BatchNorm was an int8 mul and add per conv, broadcasting kernels slower
    than the conv: DETR on fbgemm ran slower than float. It folds into the conv as a BatchNorm does,
    and the float model keeps its own weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), _FrozenBatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3), _FrozenBatchNorm2d(8)).eval()
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    quantized = _quantize(model, capture="export")
    assert all(torch.equal(value, weights[name]) for name, value in model.state_dict().items())
    report = qp.quantization_report(quantized)
    assert {f.module_name: f.fused_type for f in report.fusions} == {"0": "ConvReLU2d"}
    assert sorted(report.kernels) == ["0", "3"]
    assert not any("mul" in name or "add" in name for name in report.quantized)
    x = _data(9)
    assert qp.sqnr(model(*x), quantized(*x)) > 30


def test_a_frozen_batch_norm_folds_in_a_training_graph_too():
    """QAT: a frozen BatchNorm stays frozen (made a BatchNorm module, QAT normalised by batch statistics)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), _FrozenBatchNorm2d(8), nn.ReLU()).train()
    x = _data(9)
    qat = qp.prepare_qat_fx(model, qp.get_default_qconfig_mapping("fbgemm", "qat"), x, backend="fbgemm",
                            capture="export")
    with torch.no_grad():
        assert qp.sqnr(model(*x), qat.train()(*x)) > 30
