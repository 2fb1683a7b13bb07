"""A loaded model may modify its constants in place, as the exported original does (issue 27).

A reloaded DeBERTa-v2 crashed on its first call with "Can't detach views in-place": its exported
graph calls ``aten::detach_`` on a folded constant, and safetensors hands back every tensor as a
view of one buffer. Loaded tensors now own their storage.
"""

from __future__ import annotations

import torch
from torch import nn

import qplug_core as qp


class InPlaceConstant(nn.Module):
    """``torch.tensor(...).detach_()`` in forward: exported as a folded constant and detach_."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * torch.tensor(2.0).detach_()


def test_an_exported_graph_modifying_a_constant_in_place_runs_after_load(tmp_path):
    torch.manual_seed(0)
    example = (torch.randn(2, 8),)
    quantized = qp.quantize(InPlaceConstant().eval(), example, [example, example], backend="reference",
                            capture="export")
    assert any("detach_" in str(n.target) for n in quantized.graph.nodes)
    loaded = qp.load(qp.save(quantized, tmp_path / "model.safetensors"))
    torch.testing.assert_close(loaded(*example), quantized(*example), rtol=0, atol=0)
    assert all(t._base is None for t in [*loaded.parameters(), *loaded.buffers()])
