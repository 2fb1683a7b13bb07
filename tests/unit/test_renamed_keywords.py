"""One name for calibration batches across the public API: ``calibration_data``. The old keyword
of each sibling (``calibration=``, ``calibrate(data=)``) still works, gives the same model and
says which keyword replaces it; passing both is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval()


BATCHES = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def weights_of(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("call", [
    lambda **data: qp.quantize_weights(mlp(), bits=4, group_size=32, algorithm="awq", kernel="reference", **data),
    lambda **data: qp.quantize_w8a8(mlp(), alpha=0.5, activations="static", backend="reference", **data),
], ids=["quantize_weights", "quantize_w8a8"])
def test_the_old_calibration_keyword_gives_the_same_model_with_a_deprecation(call):
    new = call(calibration_data=BATCHES)
    with pytest.warns(DeprecationWarning, match=r"\(calibration=\.\.\.\) is deprecated: the keyword is now "
                                                r"calibration_data="):
        old = call(calibration=BATCHES)
    x = torch.randn(5, 32)
    torch.testing.assert_close(old(x), new(x), rtol=0, atol=0)
    with pytest.raises(ConfigValidationError, match="got both calibration_data= and its old name calibration="):
        call(calibration=BATCHES, calibration_data=BATCHES)


def test_calibrate_takes_calibration_data_and_its_old_keyword():
    example = (BATCHES[0],)
    new = qp.calibrate(qp.prepare_fx(mlp(), example_inputs=example, backend="reference"),
                       calibration_data=BATCHES)
    with pytest.warns(DeprecationWarning, match=r"calibrate\(data=\.\.\.\) is deprecated"):
        old = qp.calibrate(qp.prepare_fx(mlp(), example_inputs=example, backend="reference"), data=BATCHES)
    for a, b in zip(weights_of(old), weights_of(new), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    x = torch.randn(5, 32)
    torch.testing.assert_close(qp.convert_fx(old, backend="reference")(x),
                               qp.convert_fx(new, backend="reference")(x), rtol=0, atol=0)
