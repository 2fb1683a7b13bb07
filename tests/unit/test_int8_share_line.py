"""The report's headline weighs the int8 share by work (MACs where the graph's shapes are known,
weights always), not by a count of ops: a forecaster's float LSTM beside its int8 head read
"(50% int8)" with 98% of its weights float (time-series report, F4)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.flows.report import QuantizationReport, SkippedNode, int8_share_line


class Forecaster(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 32, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def test_a_float_lstm_beside_an_int8_head_reads_as_mostly_float(plugin_autoload):
    torch.manual_seed(0)
    model, x = Forecaster().eval(), torch.randn(2, 6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "...% of the model's weights stay float": tested elsewhere
        quantized = qp.quantize(model, (x,), [(x,)], backend="fbgemm", recipe="none", progress=False)
    lstm = sum(p.numel() for p in model.rnn.parameters())
    head = sum(p.numel() for p in model.head.parameters())
    share = round(100 * head / (head + lstm))
    assert int8_share_line(qp.quantization_report(quantized)) == (
        f"int8: {share}% of weights, MACs unknown for 2 op(s) without shapes (1 compute op(s) left in float)")


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x)
        return torch.softmax(q @ q.transpose(-1, -2), -1) @ self.v(x)


@pytest.mark.slow  # torch.export: ~2-4 s on the shared machine
def test_an_exported_graph_weighs_by_macs_too(plugin_autoload):
    """Two 16x16 linears on 2x12 tokens (2 x 2*12*16*16 MACs) int8, two 12x12x16 matmuls between
    activations float (2 x 2*12*12*16): 57% of the MACs, all weights."""
    x = torch.randn(2, 12, 16)
    quantized = qp.quantize(Attention().eval(), (x,), [(x,)], backend="fbgemm", capture="export", recipe="none", progress=False)
    linear, matmul = 2 * 12 * 16 * 16, 2 * 12 * 12 * 16
    share = round(100 * 2 * linear / (2 * linear + 2 * matmul))
    assert f"int8: {share}% of MACs, 100% of weights (" in str(qp.quantization_report(quantized))


def test_the_share_never_rounds_a_float_op_away():
    report = QuantizationReport("fbgemm", "static", quantized={"big": "linear"},
                                skipped=[SkippedNode("tiny", "linear", "not requested")],
                                work={"big": [100_000, 4_000_000], "tiny": [10, None]})
    assert int8_share_line(report) == ("int8: >99% of weights, MACs unknown for 1 op(s) without shapes "
                                       "(1 compute op(s) left in float)")
    report.work["tiny"] = [10, 40]
    assert int8_share_line(report) == "int8: >99% of MACs, >99% of weights (1 compute op(s) left in float)"


def test_a_report_without_work_counts_regions():
    """A report read from an older file's record, or a graph with no weights at all."""
    report = QuantizationReport("fbgemm", "static", quantized={"a": "add"},
                                skipped=[SkippedNode("b", "erf", "no pattern")])
    assert int8_share_line(report) == "int8: 1 region(s), 1 compute op(s) left in float (50% int8)"


class ConvBnReLUThenGram(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return y @ y.transpose(-1, -2)


@pytest.mark.slow  # torch.export: ~2-4 s on the shared machine
def test_a_fused_conv_bn_relu_counts_its_macs(plugin_autoload):
    """The fused ConvReLU2d (BN folded) holds its conv's MACs, 4*8*8 outputs x 3*3*3 each; the
    float matmul between activations 4*8*8 outputs x 8: 77% of the MACs (it read 0% when a fused
    region counted as no work)."""
    x = torch.randn(1, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qnnpack on x86: tested elsewhere
        quantized = qp.quantize(ConvBnReLUThenGram().eval(), (x,), [(x,)], backend="qnnpack", capture="export",
                                recipe="none", progress=False)
    conv, matmul = 4 * 8 * 8 * 27, 4 * 8 * 8 * 8
    share = round(100 * conv / (conv + matmul))
    assert f"int8: {share}% of MACs, " in str(qp.quantization_report(quantized))
