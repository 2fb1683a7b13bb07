"""Inputs nn.LSTM, nn.GRU and nn.Linear take, sent to the dynamic int8 modules that replace them
(s19/odd defects 1 and 11): each answers as the float module does, or, where the float module
refuses too, refuses with qplug's InputMismatchError."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")

ENGINES = ["fbgemm", "qnnpack"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_dynamic_linear_takes_one_vector_as_nn_linear_does(engine):
    """A 1-D input raised "The dimension of input tensor should be larger than or equal to 2"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    int8 = qp.quantize_dynamic(model, {nn.Linear}, backend=engine)
    x = torch.randn(16)
    with torch.no_grad():
        out = int8(x)
        assert out.shape == model(x).shape == (4,)
        assert torch.equal(out, int8(x.unsqueeze(0))[0])
        assert qp.sqnr(model(x), out) > 30


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("x, says", [
    (torch.randn(2, 17), r"int8 DynamicLinear takes inputs with 16 features \(last dimension\), got shape \(2, 17\)"),
    (torch.randn(()), r"int8 DynamicLinear takes inputs with 16 features \(last dimension\), got shape \(\)"),
    (torch.randn(2, 16).double(), r"int8 DynamicLinear takes float32 inputs, got float64 of shape \(2, 16\): "
                                  r"pass it .float\(\)"),
])
def test_an_input_the_float_linear_refuses_is_refused_by_name_and_shape(engine, x, says):
    """qnnpack answered a 17-feature input to a 16-feature linear; the others were raw kernel errors."""
    linear = nn.Linear(16, 4).eval()
    int8 = qp.quantize_dynamic(nn.Sequential(linear), {nn.Linear}, backend=engine)
    with pytest.raises(Exception):
        linear(x)
    with pytest.raises(InputMismatchError, match=says):
        int8(x)
