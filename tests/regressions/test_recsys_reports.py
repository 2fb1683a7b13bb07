"""Defects a recommendation/tabular-model user found (2026-12-06): each test is that user's own
call, with the numbers or the error they rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.onnx_export.api import reference_form

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class DotInteraction(nn.Module):
    """DLRM's pairwise interaction: the lower triangle of ``T @ T^T``, taken with index tensors
    computed in ``forward`` or kept as buffers."""

    def __init__(self, buffers: bool) -> None:
        super().__init__()
        self.bot, self.top = nn.Linear(8, 16), nn.Linear(6, 1)
        self.buffers = buffers
        li, lj = torch.tril_indices(4, 4, offset=-1)
        self.register_buffer("li", li)
        self.register_buffer("lj", lj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.bot(x).view(-1, 4, 4)
        z = torch.bmm(t, t.transpose(1, 2))
        li, lj = (self.li, self.lj) if self.buffers else torch.tril_indices(4, 4, offset=-1)
        return self.top(z[:, li, lj])


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("buffers", [False, True], ids=["tril_indices", "buffers"])
def test_the_dlrm_dot_interaction_quantizes_on_delegating_backends(backend, buffers):
    """The partitioner moved ``z[:, li, lj]`` between the partitions of ``z``, ``li`` and ``lj``
    forever: qp.quantize never returned on onnxruntime, openvino or auto."""
    torch.manual_seed(0)
    model = DotInteraction(buffers).eval()
    batches = [(torch.randn(64, 8),) for _ in range(4)]
    int8 = qp.quantize(model, batches[0], batches, backend=backend)
    x = torch.randn(256, 8)
    with torch.no_grad():
        out = int8(x)
        assert qp.sqnr(model(x), out) > 30  # 38.2 dB measured
        assert qp.sqnr(reference_form(int8)(x), out) > 50  # 60.2 dB
    assert qp.quantization_report(int8).partitions
