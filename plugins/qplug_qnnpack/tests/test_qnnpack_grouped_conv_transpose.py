"""A grouped ConvTranspose2d on qnnpack fell back to float: the default mapping gave it per-channel
weights, which torch's quantized transposed convs take only with groups == 1 (mobile report, 6).
The default mapping now means per-tensor weights for grouped ones; ungrouped ones stay per-channel."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp


@pytest.mark.slow  # ~2.8 s on the shared machine: prepare, convert and the kernel check
def test_a_grouped_conv_transpose_runs_int8_with_per_tensor_weights_as_its_reference_form(qplug_only):
    qplug_only("qplug-qnnpack")
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(8, 8, 2, 2), nn.ReLU(), nn.ConvTranspose2d(8, 4, 4, 2, 1, groups=4)).eval()
    calibration = [(torch.randn(2, 8, 6, 6),) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qnnpack on x86
        observed = qp.prepare_fx(model, None, calibration[0], backend="qnnpack")
        qp.calibrate(observed, calibration)
        reference = qp.convert_to_reference_fx(copy.deepcopy(observed))
        int8 = qp.convert_fx(observed)
    report = qp.quantization_report(int8)
    assert list(report.kernels.values()).count("quantized::convtranspose2d") == 2 and not report.reference
    assert reference.get_submodule("0").weight_qparams.per_channel  # ungrouped: per-channel
    assert not reference.get_submodule("2").weight_qparams.per_channel
    x = torch.randn(2, 8, 6, 6)
    dequantize = [node for node in reference.graph.nodes if node.op == "call_module" and "dequantize" in node.name]
    step = float(reference.get_submodule(dequantize[-1].target).scale)  # of the output
    with torch.no_grad():  # the kernel contract's bound: one step (requantization's rounding)
        assert (int8(x) - reference(x)).abs().max() <= step * 1.001
