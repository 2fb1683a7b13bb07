"""Zero padding and basic slices keep their input's qparams (a causal TCN is int8 end to end).

They were float islands (dequantize -> pad / slice -> quantize) at every causal conv of a TCN;
other pads (a non-zero value, reflection) would change values on the int8 grid and stay float
with the reason.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp
from qplug_core.testing import one_thread


class CausalBlock(nn.Module):
    """Both TCN formulations: pad in front of the conv, and pad in the conv then chomp the tail."""

    def __init__(self, pad=lambda x: F.pad(x, (2, 0))):
        super().__init__()
        self.pad = pad
        self.inp = nn.Conv1d(4, 4, 1)
        self.a = nn.Conv1d(4, 8, 3)
        self.b = nn.Conv1d(8, 8, 3, padding=2)
        self.zero = nn.ZeroPad1d((1, 0))
        self.c = nn.Conv1d(8, 4, 2)

    def forward(self, x):
        y = torch.relu(self.a(F.pad(self.inp(x), (2, 0))))
        y = torch.relu(self.b(self.pad(y))[..., :-2])
        return self.c(self.zero(y))


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 4, 24, generator=g).cumsum(-1),) for _ in range(3)]


@pytest.mark.parametrize("capture", ["symbolic", pytest.param("export", marks=pytest.mark.slow)])  # export: ~4 s
def test_a_causal_tcn_block_is_int8_end_to_end_and_equals_its_reference_form(capture, plugin_autoload):
    data = _data()
    with one_thread():
        observed = qp.prepare_fx(CausalBlock().eval(), None, data[0], backend="fbgemm", capture=capture)
        qp.calibrate(observed, data)
        reference = qp.convert_to_reference_fx(observed)
        lowered = qp.convert_fx(observed)
        report = str(qp.quantization_report(lowered))
        expected, got = reference(*data[1]), lowered(*data[1])
    assert "100% of weights (0 compute op(s) left in float)" in report, report
    step = float(expected.max() - expected.min()) / 255
    assert (got - expected).abs().max() <= step * 1.01


class CausalHead(nn.Module):
    """A causal conv whose last time step a linear head reads (``y[:, :, -1]``: ``aten.select``)."""

    def __init__(self, pad=lambda x: F.pad(x, (2, 0))):
        super().__init__()
        self.pad = pad
        self.inp = nn.Conv1d(4, 4, 1)
        self.conv = nn.Conv1d(4, 8, 3)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv(self.pad(self.inp(x))))[:, :, -1])


def _lowered(model, capture, data):
    with one_thread():
        observed = qp.prepare_fx(model, None, data[0], backend="fbgemm", capture=capture)
        qp.calibrate(observed, data)
        return qp.convert_to_reference_fx(observed), qp.convert_fx(observed)


@pytest.mark.slow  # three exports: 5-13 s on the shared 2-core machine
def test_export_capture_raises_selects_and_constant_pads_to_the_int8_ops_symbolic_tracing_gives(plugin_autoload):
    """``aten.select.int`` and ``aten.constant_pad_nd`` (what ``torch.constant_pad_nd`` and a
    decomposed program's pads are) stayed float at the ATen level: dequantize -> op -> quantize."""
    data = _data()
    symbolic = qp.quantization_report(_lowered(CausalHead().eval(), "symbolic", data)[1])
    for pad in (lambda x: F.pad(x, (2, 0)), lambda x: torch.constant_pad_nd(x, (2, 0))):
        reference, lowered = _lowered(CausalHead(pad).eval(), "export", data)
        report = qp.quantization_report(lowered)
        assert "int8: 100% of MACs, 100% of weights (0 compute op(s) left in float)" in str(report), report
        assert Counter(report.kernels.values()) == Counter(symbolic.kernels.values())
        with torch.no_grad():
            expected, got = reference(*data[1]), lowered(*data[1])
        assert (got - expected).abs().max() <= float(expected.max() - expected.min()) / 255 * 1.01


@pytest.mark.parametrize("pad, reason", [
    (lambda x: F.pad(x, (2, 0), value=0.5), "it pads with 0.5, not 0"),
    (lambda x: F.pad(x, (2, 0), mode="replicate"), "padding mode 'replicate' stays float"),
    (nn.ConstantPad1d((2, 0), -1.0), "it pads with -1.0, not 0"),
])
def test_a_pad_that_is_not_exact_on_the_int8_grid_stays_float_and_says_why(pad, reason, plugin_autoload):
    data = _data()
    model = CausalBlock(pad).eval()
    with one_thread():
        quantized = qp.quantize(model, data[0], data, backend="fbgemm", progress=False)
        got, expected = quantized(*data[1]), model(*data[1])
    assert reason in str(qp.quantization_report(quantized))
    assert F.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.999
