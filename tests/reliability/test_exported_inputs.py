"""How calibrating models take their inputs (an outside tester's reports, session 21): a calibration
batch whose mask changed kind gets qplug's error naming the batch and the input. (A misspelt or
missing input: tests/regressions/test_builtin_blocks_calls.py, beside the delegated models' case.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class MaskedHead(nn.Module):
    """Two linears with a padding mask between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).masked_fill(mask.unsqueeze(-1), 0.0))


def _inputs(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return [(torch.randn(2, 8, 16), torch.rand(2, 8) > 0.7) for _ in range(count)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MaskedHead().eval()


@pytest.mark.parametrize("capture", ["symbolic", "export"])
@pytest.mark.parametrize("backend", ["fbgemm", "onnxruntime"])
def test_a_calibration_batch_with_a_float_mask_is_refused_before_the_graph_runs(backend, capture, capfd):
    """A float mask in a calibration batch where a bool one was captured printed torch's FX
    traceback ("Call using an FX-traced Module ... generated forward function") to stderr before
    qplug's error. Calibration now checks each input's kind before running a batch, as the
    converted model does: qplug's error names the batch and the input, and stderr stays clean."""
    batches = _inputs(3)
    x, mask = batches[1]
    batches[1] = (x, mask.float())
    capfd.readouterr()
    with pytest.raises(InputMismatchError, match=r"calibration batch 1: input 'mask' is float32 where the int8 "
                                                 r"model was captured with bool.*Pass mask as bool"):
        qp.quantize(_model(), batches[0], batches, backend=backend, capture=capture)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "generated forward" not in err, err
