"""A keyword the capture fixed: an equal value of another type is taken, another value gets the right
advice, the same in memory and after qp.load (qplug_core/ir/fixed_values.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, scale: float = 1.0, mask=None, flag: bool = False, interpolate=None):
        y = self.fc(x) * scale
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return -y if flag or interpolate else y


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    model = _Scaled().eval()
    batches = [(torch.randn(2, 8),) for _ in range(2)]
    quantized = qp.quantize(model, batches[0], batches, backend="fbgemm", capture="export")
    path = tmp_path_factory.mktemp("fixed") / "m.safetensors"
    qp.save(quantized, path)
    return batches[0][0], quantized, qp.load(path)


@pytest.mark.parametrize("side", [1, 2])
def test_equal_values_of_another_type_are_taken(models, side):
    x, q = models[0], models[side]
    expected = q(x)
    for given in ({"scale": 1}, {"scale": torch.tensor(1.0)}, {"flag": False}, {"interpolate": None}):
        assert torch.equal(q(x, **given), expected), given


@pytest.mark.parametrize("side", [1, 2])
def test_other_values_are_refused_with_advice_that_fits(models, side):
    x, q = models[0], models[side]
    with pytest.raises(InputMismatchError, match="flag was fixed at False"):
        q(x, flag=0)  # a bool only equals a bool
    with pytest.raises(InputMismatchError) as mask:
        q(x, mask=torch.zeros(64, 64, dtype=torch.bool))
    text = str(mask.value)
    assert "add it to example_inputs" in text and "<tensor of shape (64, 64), bool>" in text
    assert "tensor(" not in text and "model.config" not in text and len(text) < 400
    with pytest.raises(InputMismatchError, match="known only by running it") as interpolate:
        q(x, interpolate=False)
    assert "model.config" not in str(interpolate.value)
    # how to capture the value the call gives (None and False are not provably the same to a model)
    assert "pass functools.partial(model, interpolate=False) to qp.quantize" in str(interpolate.value)


def test_the_advised_partial_gives_an_int8_model_taking_the_value(plugin_autoload):
    torch.manual_seed(0)
    model = _Scaled().eval()
    batches = [(torch.randn(2, 8),) for _ in range(2)]
    q = qp.quantize(functools.partial(model, interpolate=False), batches[0], batches, backend="fbgemm")
    x = batches[1][0]
    assert torch.equal(q(x, interpolate=False), q(x))
    assert torch.nn.functional.cosine_similarity(q(x).flatten(), model(x, interpolate=False).flatten(), 0) > 0.999
    with pytest.raises(InputMismatchError, match="interpolate was fixed at False"):
        q(x, interpolate=None)
