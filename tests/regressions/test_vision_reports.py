"""Defects a detection/segmentation user found (2026-12-06): each test is that user's own call, with
the numbers or the error they rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.eager import DeQuantStub, QuantStub
from qplug_core.errors import ConfigValidationError

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
