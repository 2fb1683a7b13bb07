"""Defects a detection/segmentation user found (s29 detseg, 2026-12-07): each test is that user's
own pattern, checked against the reference form of the same calibration."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class TokensToMap(nn.Module):
    """SegFormer's all-MLP decoder: a linear over tokens, transposed and reshaped into a map, then
    upsampled or pooled. At batch 1 that map is a view torch calls channels-last whose batch stride
    is the channel count, which torch's int8 upsampling and pooling misread."""

    def __init__(self, resize) -> None:
        super().__init__()
        self.resize = resize
        self.proj = nn.Linear(16, 16)
        self.fuse = nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.proj(x.flatten(2).transpose(1, 2))
        grid = tokens.transpose(1, 2).reshape(x.shape[0], -1, x.shape[2], x.shape[3])
        return self.fuse(self.resize(grid))


RESIZES = {
    "bilinear": lambda m: F.interpolate(m, size=(24, 24), mode="bilinear", align_corners=False),
    "nearest": lambda m: F.interpolate(m, scale_factor=2.0, mode="nearest"),
    "max_pool": lambda m: F.max_pool2d(m, 2),
    "adaptive_avg_pool": lambda m: F.adaptive_avg_pool2d(m, 3),
}


@pytest.mark.parametrize("resize", sorted(RESIZES))
def test_a_map_of_transposed_tokens_is_resized_in_int8_right_at_batch_1(resize, recwarn):
    """F1: SegFormer on fbgemm gave logits at cosine 0.31 to float at batch 1 (0.999 at batch 2),
    silently: the int8 upsampling read the decoder's view wrong. It now runs int8 and right."""
    torch.manual_seed(0)
    data = [torch.randn(1, 16, 8, 8) for _ in range(3)]
    observed = qp.calibrate(qp.prepare_fx(TokensToMap(RESIZES[resize]).eval(), None, (data[0],),
                                          backend="fbgemm"), data)
    lowered, reference = qp.convert_fx(observed), qp.convert_to_reference_fx(observed)
    resized = [name for name, op in qp.quantization_report(lowered).kernels.items() if op == "passthrough"]
    assert resized and not [w for w in recwarn if "kernel contract" in str(w.message)]
    for x in (data[2], torch.randn(2, 16, 8, 8)):
        with torch.no_grad():
            expected = reference(x)
            step = 2 * float(expected.abs().max()) / 255
            # int8 averaging rounds its mean (up to 3 steps after the 1x1 conv); misread: 110-210
            assert float((lowered(x) - expected).abs().max()) <= 4 * step
