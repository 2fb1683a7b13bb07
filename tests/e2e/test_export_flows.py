"""QAT, dynamic quantization and save/load on exported graphs (issue 13), and the items of issue 19
found by real models that live on the export path (19.12 weight norm, 19.15 Conv1D, attention).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import qplug_core as qp
from tests.support.flops import int8_flop_share
from tests.support.hf_models import build_hf_model, hf_inputs

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_export_capture import ConvBnNet, _data

pytestmark = [pytest.mark.usefixtures("plugin_autoload", "one_thread"), pytest.mark.slow]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _qat_trained(capture: str) -> nn.Module:
    torch.manual_seed(0)
    prepared = qp.prepare_qat_fx(ConvBnNet().train(), None, _data(0), backend="fbgemm",
                                 capture=capture)
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
    torch.manual_seed(1)  # same dropout masks for both captures
    for step in range(3):
        loss = prepared(*_data(step)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return qp.convert_fx(prepared.eval())


def test_qat_on_the_exported_training_graph_matches_symbolic_qat():
    # export records training-mode batch norm and dropout; both become modules again, so QAT
    # modules, fake-quant, training and BN folding at convert are those of the symbolic path
    symbolic, exported = _qat_trained("symbolic"), _qat_trained("export")
    report = qp.quantization_report(exported)
    assert report.capture == "export"
    assert report.kernels == qp.quantization_report(symbolic).kernels
    assert report.kernels["conv1"] == "quantized::conv2d"  # conv + bn + relu, bn folded
    assert torch.equal(exported(*_data(9)), symbolic(*_data(9)))


def test_dynamic_quantization_converts_gpt2_conv1d_and_exported_programs():
    model = build_hf_model("gpt2")
    x = hf_inputs("gpt2", seed=3)
    swapped = qp.quantize_dynamic(model, backend="fbgemm")
    kinds = {type(m).__name__ for m in swapped.modules()}
    assert "Conv1D" not in kinds and "DynamicLinear" in kinds  # GPT-2's projections are linears
    program = torch.export.export(model, hf_inputs("gpt2"), strict=False)
    exported = qp.quantize_dynamic(program, backend="fbgemm")
    assert sum(type(m).__name__ == "DynamicLinear" for m in exported.modules()) == 8
    with torch.no_grad():
        reference = model(*x)
        assert _cosine(reference, swapped(*x)) >= 0.999
        assert _cosine(reference, exported(*x)) >= 0.999


class WeightNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = weight_norm(nn.Conv1d(8, 16, 3, padding=1), dim=2)
        self.fc = weight_norm(nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.conv(x)).mean(-1))


@pytest.mark.parametrize("capture", ["symbolic", "export"])
def test_weight_norm_conv_and_linear_lower_statically(capture):
    torch.manual_seed(0)
    model = WeightNormNet().eval()
    data = [(torch.randn(4, 8, 20, generator=torch.Generator().manual_seed(s)),) for s in range(4)]
    quantized = qp.quantize(model, data[0], data[:3], backend="fbgemm", capture=capture)
    kernels = qp.quantization_report(quantized).kernels
    assert kernels["conv"] == "quantized::conv1d" and kernels["fc"] == "quantized::linear"
    assert qp.sqnr(model(*data[3]), quantized(*data[3])) > 30


def test_weight_norm_linear_quantizes_dynamically():
    torch.manual_seed(0)
    model = WeightNormNet().eval()
    x = torch.randn(4, 8, 20)
    dynamic = qp.quantize_dynamic(model, backend="fbgemm")
    assert type(dynamic.fc).__name__ == "DynamicLinear"
    assert qp.sqnr(model(x), dynamic(x)) > 30


class TorchEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def test_torch_transformer_encoder_projections_run_int8_by_default():
    # symbolic tracing keeps nn.TransformerEncoder a leaf (all float); auto capture exports it
    torch.manual_seed(0)
    model = TorchEncoder().eval()
    batches = [(torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(s)),) for s in range(5)]
    quantized = qp.quantize(model, batches[0], batches[:4], backend="fbgemm")
    assert qp.quantization_report(quantized).capture == "export"
    share = int8_flop_share(model, quantized, batches[0])
    assert share.share >= 0.9
    assert {"encoder.layers.0.self_attn.in_proj", "encoder.layers.0.self_attn.out_proj",
            "encoder.layers.0.linear1"} <= set(share.by_module)
    with torch.no_grad():
        assert _cosine(model(*batches[4]), quantized(*batches[4])) >= 0.999


class _UpsamplingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down, self.head = nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.head(F.interpolate(self.down(x), scale_factor=2.0, mode="nearest"))


def test_the_flop_share_counts_through_int8_upsampling():
    """The FLOP helper raised "Invalid dtype!" on CNNs whose F.interpolate fbgemm runs int8 (YOLO,
    FPN): torch's flop counter tried upsampling's Python decomposition on a quantized tensor."""
    torch.manual_seed(0)
    model = _UpsamplingNet().eval()
    batches = [(torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    quantized = qp.quantize(model, batches[0], batches, backend="fbgemm")
    share = int8_flop_share(model, quantized, batches[0])
    assert share.share == 1.0 and set(share.by_module) == {"down", "head"}


@pytest.mark.parametrize("name", ["gpt2", "wav2vec2"])
def test_models_quantized_from_exported_graphs_save_and_load(name, tmp_path):
    model = build_hf_model(name)
    x = hf_inputs(name)
    quantized = qp.quantize(model, x, [x], backend="fbgemm")
    path = tmp_path / "model.safetensors"
    qp.save(quantized, path)
    loaded = qp.load(path)
    assert qp.quantization_report(loaded).kernels == qp.quantization_report(quantized).kernels
    held_out = hf_inputs(name, seed=7)
    assert torch.equal(loaded(*held_out), quantized(*held_out))
