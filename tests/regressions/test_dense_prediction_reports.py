"""Defects a detection/segmentation user found (s27 dense, 2026-12-07): each test is that user's
own call, with the numbers or the error they rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class SharedHead(nn.Module):
    """RetinaNet/FCOS style: one ``nn.Sequential`` tower and classifier called on every FPN level."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.tower = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.cls = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        p3 = self.stem(x)
        return [self.cls(self.tower(p)) for p in (p3, self.down(p3))]


def test_a_shared_sequential_head_is_saved_and_loaded(tmp_path):
    """F5: the second call's copy of ``tower.0`` was named ``tower.0_call1``, which ``qp.save``
    refused ("attribute path 'tower.0_call1' is not a dotted path of identifiers or indices")."""
    torch.manual_seed(0)
    data = [torch.randn(1, 3, 16, 16) for _ in range(3)]
    quantized = qp.quantize(SharedHead().eval(), data[0], data[:2], backend="fbgemm")
    loaded = qp.load(qp.save(quantized, tmp_path / "head.safetensors"))
    with torch.no_grad():
        before, after = quantized(data[2]), loaded(data[2])
    assert type(after) is list and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
