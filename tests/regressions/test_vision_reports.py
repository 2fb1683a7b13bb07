"""Defects a detection/segmentation user found (2026-12-06): each test is that user's own call, with
the numbers or the error they rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.eager import DeQuantStub, QuantStub
from qplug_core.errors import ConfigValidationError, InputMismatchError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class DepthwiseBlock(nn.Module):
    """MobileNet-style: pointwise, depthwise, pointwise, each conv fused with its ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.pw1, self.r1 = nn.Conv2d(3, 16, 1), nn.ReLU()
        self.dw, self.r2 = nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU()
        self.pw2 = nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.pw2(self.r2(self.dw(self.r1(self.pw1(self.quant(x)))))))


def _eager(model: nn.Module, backend: str) -> nn.Module:
    fused = qp.eager.fuse_modules(model, [["pw1", "r1"], ["dw", "r2"]])
    observed = qp.eager.prepare(fused, backend=backend)
    with torch.no_grad():
        for seed in range(4):
            observed(torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(seed)))
    return qp.eager.convert(observed)


def test_eager_fbgemm_runs_a_fused_depthwise_conv_on_its_kernel_as_accurately_as_graph_mode(recwarn):
    """The depthwise conv's input got 8 bits, fbgemm's kernel refused it and it ran as a float conv
    between dequantize/quantize (eager "int8" 3.6-5x slower than float), with a warning blaming the
    qparams qplug itself had chosen."""
    torch.manual_seed(0)
    model = DepthwiseBlock().eval()
    eager = _eager(model, "fbgemm")
    assert [str(w.message) for w in recwarn if str(w.message).startswith("qplug: ")] == []
    assert not any(isinstance(m, qp.eager.SimulatedOutput) or type(m).__name__ == "Dequantize"
                   for m in eager.dw.modules())
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(9))
    graph = qp.quantize(model, (x[:1],), [x[:4]], backend="fbgemm")
    with torch.no_grad():
        expected, got, graph_mode = model(x), eager(x), graph(x)
    assert float(qp.sqnr(expected, got)) > float(qp.sqnr(expected, graph_mode)) - 3


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.conv(self.quant(x)))


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_eager_prepare_refuses_a_backend_that_compiles_graphs_and_names_graph_mode(backend):
    """Eager mode took onnxruntime/openvino and silently converted to the reference backend's
    simulated int8: no ORT/OpenVINO session, 2-3x slower than float, not one warning."""
    pytest.importorskip(backend)
    with pytest.raises(ConfigValidationError, match=rf"backend '{backend}' compiles int8 graphs.*"
                                                    rf"qp\.quantize\(.*backend='{backend}'\).*fbgemm, qnnpack"):
        qp.eager.prepare(ConvNet().eval(), backend=backend)


def test_eager_convert_refuses_a_backend_that_compiles_graphs():
    pytest.importorskip("onnxruntime")
    observed = qp.eager.prepare(ConvNet().eval(), backend="reference")
    with torch.no_grad():
        observed(torch.randn(2, 3, 16, 16))
    with pytest.raises(ConfigValidationError, match="backend 'onnxruntime' compiles int8 graphs"):
        qp.eager.convert(observed, backend="onnxruntime")


class DetectorWithPostProcessing(nn.Module):
    """A head whose post-processing (topk indices, an argmax mask) compiles into the partition."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.boxes, self.classes = nn.Conv2d(16, 4, 1), nn.Conv2d(16, 5, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.body(x)
        boxes, scores = self.boxes(features), torch.sigmoid(self.classes(features))
        best = scores.amax(dim=1).flatten(1)
        return {"boxes": boxes, "scores": scores, "top": torch.topk(best, 20, dim=-1).indices,
                "mask": scores.argmax(dim=1)}


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_compare_rates_a_partition_by_its_float_outputs_and_counts_equal_indices(backend):
    """Topk indices and argmax masks computed in the partition were converted to float and counted
    in its SQNR: 3.7-4.6 dB (an index off by 1,040) for a partition whose float outputs are at 43 dB."""
    pytest.importorskip(backend)
    torch.manual_seed(0)
    model = DetectorWithPostProcessing().eval()
    batches = [torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    quantized = qp.quantize(model, (batches[0][:1],), batches, backend=backend)
    row = next(layer for layer in qp.compare(qp.fuse_fx(model, backend=backend), quantized, batches).layers
               if layer.name == "delegate_0")
    with torch.no_grad():
        expected, got = model(batches[0]), quantized(batches[0])
    float_outputs = min(float(qp.sqnr(expected[k], got[k])) for k in ("boxes", "scores"))
    assert float_outputs > 25
    assert row.sqnr_db > float_outputs - 3
    assert row.integer_agreement is not None and 0.9 < row.integer_agreement <= 1.0
    assert row.num_outputs == 4 * len(batches)


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_an_unbatched_image_runs_as_the_float_model_runs_it(backend):
    """The float convs take an unbatched (C, H, W) image; the int8 model said it needed 3 channels
    (dimension 1), which the image had: it lacked the batch dimension."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    quantized = qp.quantize(model, (torch.randn(1, 3, 16, 16),), [torch.randn(2, 3, 16, 16)], backend=backend)
    image = torch.randn(3, 16, 16)
    with torch.no_grad():
        got, batched = quantized(image), quantized(image.unsqueeze(0))
        assert torch.equal(got, batched[0])
        assert float(qp.sqnr(model(image), got)) > 30


def test_an_input_of_another_rank_is_refused_with_the_ranks_the_conv_takes():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1)).eval()
    quantized = qp.quantize(model, (torch.randn(1, 3, 16, 16),), [torch.randn(2, 3, 16, 16)], backend="fbgemm")
    with pytest.raises(InputMismatchError, match=r"int8 Conv2d takes 4-D inputs \(N, C, H, W\) or "
                                                    r"unbatched 3-D ones.*got shape \(16, 16\)"):
        quantized(torch.randn(16, 16))
