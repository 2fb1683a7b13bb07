"""A model torch.ao prepared or converted is refused by qplug's first call, naming torch.ao's modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ModelStateError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")
quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
ao = pytest.importorskip("torch.ao.quantization")

EXAMPLE = (torch.randn(2, 3, 8, 8),)


def _ao_prepared() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    mapping = ao.QConfigMapping().set_global(ao.get_default_qconfig("fbgemm"))
    return quantize_fx.prepare_fx(model, mapping, EXAMPLE)


@pytest.mark.parametrize("call", [
    lambda m: qp.prepare_fx(m, None, EXAMPLE, backend="fbgemm"),
    lambda m: qp.calibrate(m, [EXAMPLE]),
    lambda m: qp.convert_fx(m),
])
def test_a_torch_ao_prepared_model_is_refused_by_name(call):
    with pytest.raises(ModelStateError, match=r"prepared by torch\.ao.*activation_post_process_0: "
                                              r"torch\.ao\.quantization\.observer\..*qp\.prepare_fx"):
        call(_ao_prepared())


@pytest.mark.parametrize("call", [
    lambda m: qp.prepare_fx(m, None, EXAMPLE, backend="fbgemm"),
    lambda m: qp.quantize_dynamic(m, {nn.Linear}, torch.qint8, backend="fbgemm"),
])
def test_a_torch_ao_converted_model_is_refused_by_name(call):
    prepared = _ao_prepared()
    prepared(*EXAMPLE)
    with pytest.raises(ModelStateError, match=r"quantized by torch\.ao.*torch\.ao\.nn\.intrinsic\.quantized"):
        call(quantize_fx.convert_fx(prepared))


class SkipAdd(nn.Module):
    """A float model written for torch.ao's eager mode: its skip add is a ``FloatFunctional``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.skip = torch.ao.nn.quantized.FloatFunctional()

    def forward(self, x):
        return self.skip.add(self.conv(x), x)


def test_a_float_model_with_torch_aos_float_functional_is_quantized():
    """``FloatFunctional`` is float and lives among torch.ao's int8 modules: not a converted model."""
    model = SkipAdd().eval()
    quantized = qp.quantize(model, EXAMPLE, [EXAMPLE], backend="fbgemm", recipe="none")
    assert torch.nn.functional.cosine_similarity(quantized(*EXAMPLE).flatten(), model(*EXAMPLE).flatten(), 0) > 0.99
