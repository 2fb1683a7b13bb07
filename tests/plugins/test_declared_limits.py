"""Limits a backend declares as one fact each (report s30/vendor, finding 5): an accumulator of
int16 for the whole dot product (``Int8Arithmetic.INT16``) and symmetric weights only
(``symmetric_weights = True``). An installed plugin declares both; its kernel checks neither."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.observers import MinMaxObserver, PerChannelMinMaxObserver
from qplug_core.plugin_api import Int8Arithmetic, cpu_diagnostic

LIMITED = '''
import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.plugin_api import (
    BackendPlugin, DTypeConfigSet, Int8Arithmetic, KernelSpec, kernel_table,
    default_op_quint8_dtype_config, weighted_op_quint8_dtype_config)


class IntLinear(nn.Module):
    """uint8 codes in and out, the reference form's arithmetic (no limit checked here)."""

    def __init__(self, ctx):
        super().__init__()
        w, self.x, self.out = ctx.weight_qparams, ctx.input_qparams[0], ctx.output_qparams
        scale, zero = w.scale.reshape(-1, 1), w.zero_point.reshape(-1, 1)
        codes = torch.clamp(torch.round(ctx.root.weight.detach() / scale) + zero, w.quant_min, w.quant_max)
        self.weight, self.bias = (codes - zero) * scale, ctx.root.bias.detach()

    def forward(self, q):
        y = F.linear((q.float() - self.x.zero_point) * self.x.scale, self.weight, self.bias)
        out = torch.round(y / self.out.scale) + self.out.zero_point
        return out.clamp(self.out.quant_min, self.out.quant_max).to(torch.uint8)


class Limited(BackendPlugin):
    name = "limited"
    int8_arithmetic = Int8Arithmetic.INT16
    symmetric_weights = True
    dtype_configs = DTypeConfigSet(weighted_op=(weighted_op_quint8_dtype_config,),
                                   default_op=(default_op_quint8_dtype_config,))

    def kernels(self):
        return kernel_table(self.pattern_configs(), weighted={nn.Linear: KernelSpec("limited::linear", build=IntLinear)})

    def qconfig_options(self, mode):
        return {"per_channel": True} if mode == "static" else None


plugin = Limited()
'''


class Narrow(nn.Module):
    """One input per output (fits int16: 127 * 255), then sixteen (cannot)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.one, self.wide = nn.Linear(1, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.wide(self.one(x))


@pytest.fixture
def limited(fake_dist):
    fake_dist("qplug-limited", LIMITED, module="qplug_limited:plugin")
    return "limited"


def _quantize(backend: str, mapping=None):
    data = [(torch.randn(8, 1, generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    with pytest.warns(UserWarning) as caught:
        qmodel = qp.quantize(Narrow().eval(), data[0], data, backend=backend, qconfig_mapping=mapping,
                             progress=False)
    return qp.quantization_report(qmodel), " ".join(str(w.message) for w in caught)


def test_symmetric_weights_are_the_default(limited):
    weight = qp.get_default_qconfig_mapping(backend=limited).global_qconfig.weight()
    assert (weight.quant_min, weight.quant_max, weight.qscheme) == (-127, 127, torch.per_channel_symmetric)


def test_a_layer_whose_dot_product_can_exceed_int16_keeps_the_reference_form(limited):
    report, warned = _quantize(limited)
    assert report.kernels == {"one": "limited::linear"}
    assert set(report.reference) == {"wide"}
    assert "accumulates each dot product in int16, and this layer's can reach" in report.reference["wide"]
    assert "wide" in warned and "int16" in warned


def test_asymmetric_weights_keep_the_reference_form(limited):
    affine = qp.config.QConfig(activation=MinMaxObserver.with_args(dtype=torch.quint8),
                               weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                                                        qscheme=torch.per_channel_affine))
    report, _ = _quantize(limited, qp.config.QConfigMapping().set_global(affine))
    assert report.kernels == {} and set(report.reference) == {"one", "wide"}
    assert all("symmetric weights only" in reason for reason in report.reference.values())


def test_doctor_says_what_int16_accumulation_means():
    finding = cpu_diagnostic(Int8Arithmetic.INT16)
    assert finding.level == "ok" and "whole dot products in int16" in finding.message
