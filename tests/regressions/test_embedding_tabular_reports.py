"""Defects a recommendation/tabular-model user found (2026-12-06): each test is that user's own
call, with the numbers or the error they rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class PaddedBag(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(100, 8, mode=mode, padding_idx=0)
        self.fc = nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(idx, off))


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_bag_padded_only_at_serving_time_leaves_the_padding_out(backend, mode):
    """The 8-bit bag kernel ignored padding_idx: a mean bag padded at serving time was the float
    bag x real count / padded count (max error 0.15-0.18), and the contract check could not see
    it because the example and calibration bags held no padding."""
    torch.manual_seed(0)
    model = PaddedBag(mode).eval()
    with torch.no_grad():
        model.bag.weight[0].normal_()  # a loaded checkpoint's padding row need not be zero
    example = (torch.tensor([5, 6, 7, 8]), torch.tensor([0, 2]))
    calibration = [(torch.randint(1, 100, (40,)), torch.arange(0, 40, 4)) for _ in range(4)]
    int8 = qp.quantize(model, example, calibration, backend=backend)
    assert qp.quantization_report(int8).kernels["bag"] == "quantized::embedding_bag_byte"
    idx, off = torch.tensor([5, 6, 0, 0, 7, 8, 9, 0, 0, 0]), torch.tensor([0, 4, 8])  # last bag: all padding
    with torch.no_grad():
        error = (int8.bag(idx, off) - model.bag(idx, off)).abs().max()
    assert error < 0.02  # row quantization: 0.003-0.008 measured; 0.15-0.18 (mean) before
