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


class _MaskHead(nn.Module):
    """MaskFormer's mask logits: an einsum of query embeddings and pixel features (export keeps
    ``aten.einsum``, whose ``path`` argument is a contraction order, not a file)."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Linear(8, 8)
        self.pixels = nn.Conv2d(8, 8, 1)

    def forward(self, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bqc,bchw->bqhw", self.queries(q), self.pixels(x))


def test_an_exported_einsum_saves_and_loads_to_the_same_outputs(tmp_path):
    torch.manual_seed(0)
    data = [(torch.randn(1, 5, 8), torch.randn(1, 8, 6, 6)) for _ in range(2)]
    quantized = qp.quantize(_MaskHead().eval(), data[0], data, backend="reference", capture="export")
    assert torch.ops.aten.einsum.default in {n.target for n in quantized.graph.nodes}
    loaded = qp.load(qp.save(quantized, tmp_path / "model.safetensors"))
    assert torch.equal(loaded(*data[1]), quantized(*data[1]))
