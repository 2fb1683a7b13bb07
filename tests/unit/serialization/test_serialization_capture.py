"""The capture level survives save -> load (issue 27): ``qplug report`` of an exported model said
"symbolic" because the file did not record how the model was captured."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp


@pytest.mark.parametrize("capture", ["symbolic", "export"])
def test_capture_level_is_kept_through_save_and_load(tmp_path, capture):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    data = [torch.randn(4, 8) for _ in range(2)]
    quantized = qp.quantize(model, data[0], data, backend="reference", capture=capture)
    assert qp.quantization_report(quantized).capture == capture
    loaded = qp.load(qp.save(quantized, tmp_path / "model.safetensors"))
    assert qp.quantization_report(loaded).capture == capture
