"""Float islands between int8 Conv1d keep the convs' channels-last layout (flows/conv1d_layout.py).

Dequantize made a Conv1d's (C*L, 1, C)-strided output contiguous (a transposing copy: 87 vs 12 us
at 1 x 64 x 2000) and Quantize gave the next conv a contiguous tensor it transposed back; where only
elementwise float ops lie between two int8 Conv1d, both boundaries now keep the layout. The values
must be those of the contiguous path, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp
from qplug_core.kernels._common import per_tensor_qparams
from qplug_core.kernels.boundary import Dequantize, Quantize
from qplug_core.testing import one_thread


class GeluMishStack(nn.Module):
    def __init__(self, tail=lambda y: y):
        super().__init__()
        self.tail = tail
        self.a, self.b = nn.Conv1d(4, 16, 5, stride=2), nn.Conv1d(16, 16, 3, stride=2)
        self.c = nn.Conv1d(16, 8, 3)

    def forward(self, x):
        return self.tail(self.c(F.mish(self.b(F.gelu(self.a(x))))))


def _quantized(model):
    data = [(torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    with one_thread():
        return qp.quantize(model.eval(), data[0], data, backend="fbgemm", capture="symbolic",
                           progress=False), data[1][0]


def _kept(model) -> dict[str, bool]:
    return {name: m.keep_conv1d_layout for name, m in model.named_modules() if type(m) in (Dequantize, Quantize)}


def test_the_boundaries_between_int8_conv1d_keep_the_layout_and_give_the_same_values(plugin_autoload):
    int8, x = _quantized(GeluMishStack())
    assert _kept(int8) == {"x_quantize_0": False, "a_dequantize_1": True, "gelu_quantize_2": True,
                           "b_dequantize_3": True, "mish_quantize_4": True, "c_dequantize_5": False}
    contiguous = copy.deepcopy(int8)
    for module in contiguous.modules():
        if type(module) in (Dequantize, Quantize):
            module.keep_conv1d_layout = False
    with torch.no_grad():
        assert torch.equal(int8(x), contiguous(x))
        assert int8(x).is_contiguous()  # what leaves the int8 model is contiguous, as before


def test_an_island_that_reaches_anything_but_an_elementwise_op_and_a_conv_stays_contiguous(plugin_autoload):
    """``view`` needs contiguity: the island after ``c`` reaches one (the two before it do not)."""
    int8, x = _quantized(GeluMishStack(tail=lambda y: F.gelu(y).view(y.shape[0], -1)))
    kept = _kept(int8)
    assert kept["b_dequantize_3"] and not kept["c_dequantize_5"]
    with torch.no_grad():
        assert int8(x).shape == (2, 8 * 12)


@pytest.mark.parametrize("kind", [Dequantize, Quantize])
def test_a_boundary_keeping_the_layout_gives_the_contiguous_path_values(kind):
    qparams = per_tensor_qparams(0.02, 128)
    float_4d = torch.randn(2, 64, 1, 50).contiguous(memory_format=torch.channels_last)
    source = float_4d if kind is Quantize else Quantize(qparams)(float_4d)
    conv_layout = source.squeeze(2)  # strides (C*L, 1, C): a quantized Conv1d's output
    plain = kind() if kind is Dequantize else kind(qparams)
    kept = copy.deepcopy(plain)
    kept.keep_conv1d_layout = True
    expected, got = plain(conv_layout), kept(conv_layout)
    assert got.stride() == conv_layout.stride() and expected.is_contiguous()
    if kind is Quantize:
        expected, got = expected.int_repr(), got.int_repr()
    assert torch.equal(got, expected)
