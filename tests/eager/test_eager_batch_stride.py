"""Eager mode runs upsampling and pooling modules on the int8 tensors they get: torch's int8
kernels misread a batch-1 view of transposed tokens reshaped into a map (SegFormer's decoder), so
convert hands them a dense batch stride, as graph mode's lowering does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class TokensToMap(nn.Module):
    """A linear over tokens, transposed and reshaped into a map (batch stride C at batch 1),
    resized by a module, then a 1x1 conv."""

    def __init__(self, resize: nn.Module) -> None:
        super().__init__()
        self.proj, self.resize, self.fuse = nn.Linear(16, 16), resize, nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.proj(x.flatten(2).transpose(1, 2))
        return self.fuse(self.resize(tokens.transpose(1, 2).reshape(x.shape[0], -1, x.shape[2], x.shape[3])))


RESIZES = {
    "bilinear": lambda: nn.Upsample(size=(24, 24), mode="bilinear", align_corners=False),
    "nearest": lambda: nn.Upsample(scale_factor=2.0, mode="nearest"),
    "max_pool": lambda: nn.MaxPool2d(2),
    "adaptive_avg_pool": lambda: nn.AdaptiveAvgPool2d(3),
}


class _Interpolate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2.0, mode="nearest")


def _module(resize: str) -> nn.Module:
    return _Interpolate() if resize == "functional" else RESIZES[resize]()


def _converted(resize: str, backend: str) -> nn.Module:
    torch.manual_seed(0)
    observed = qp.eager.prepare(qp.eager.QuantWrapper(TokensToMap(_module(resize)).eval()), backend=backend)
    with torch.no_grad():
        for seed in range(3):
            observed(torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(seed)))
    return qp.eager.convert(observed)


@pytest.mark.parametrize("resize", sorted(RESIZES))
def test_a_map_of_transposed_tokens_is_resized_in_int8_right_at_batch_1(resize, recwarn):
    """Before: 100-190 steps off the reference form at batch 1 (and the check's drift warning)."""
    int8, reference = _converted(resize, "fbgemm"), _converted(resize, "reference")
    assert not [str(w.message) for w in recwarn if str(w.message).startswith("qplug: ")]
    assert isinstance(int8.module.resize, type(RESIZES[resize]()))  # the user's module, kept as is
    assert len(int8.module.resize._forward_pre_hooks) == 1  # the restride: a batch-1 view reaches it
    for batch in (1, 2):
        x = torch.randn(batch, 16, 8, 8, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            expected = reference(x)
            step = 2 * float(expected.abs().max()) / 255
            # int8 averaging rounds its mean (up to 3 steps after the 1x1 conv)
            assert float((int8(x) - expected).abs().max()) <= 4 * step


def test_an_interpolate_called_in_forward_is_named_in_the_checks_warning():
    """Eager convert cannot reach a function called in forward(): its check's drift warning says
    which functions misread the view and what to use instead."""
    with pytest.warns(UserWarning, match=r"the int8 model is wrong on the prepared model's first call.*"
                                         r"F\.interpolate and the 2-d/3-d pooling functions .* use the modules "
                                         r"\(nn\.Upsample"):
        _converted("functional", "fbgemm")


class GlobalPoolBranch(nn.Module):
    """DeepLab's ASPP pooling branch: a global average pool and a projection (here a linear layer,
    whose output torch reads wrong), upsampled back to the map and concatenated with it."""

    def __init__(self, upsample: nn.Module) -> None:
        super().__init__()
        self.conv, self.pool, self.proj = nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Linear(8, 8)
        self.up, self.cat, self.fuse = upsample, qp.eager.FloatFunctional(), nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        pooled = self.proj(self.pool(y).flatten(1)).reshape(-1, 8, 1, 1)
        return self.fuse(self.cat.cat([y, self.up(pooled)], 1))


UPSAMPLINGS = {
    "bilinear from 1x1": (lambda: nn.Upsample(size=(6, 6), mode="bilinear"), "bilinear upsampling of a 1x1 map"),
    "UpsamplingBilinear2d from 1x1": (lambda: nn.UpsamplingBilinear2d(size=(6, 6)), "bilinear upsampling of a 1x1 map"),
    "bicubic": (lambda: nn.Upsample(size=(6, 6), mode="bicubic"), "upsampling mode 'bicubic' has no int8 kernel"),
}


@pytest.mark.parametrize("upsampling", sorted(UPSAMPLINGS))
def test_an_upsampling_torch_gets_wrong_in_int8_runs_in_float_with_a_warning(upsampling):
    """Graph mode's passthrough check refuses these calls (torch's int8 bilinear from a 1x1 map is
    up to 250 steps off; bicubic has no int8 kernel and raised at every call); eager convert left
    the module on int8 tensors. It now asks the same check, on the shapes seen in calibration."""
    make, reason = UPSAMPLINGS[upsampling]
    torch.manual_seed(0)
    float_model = qp.eager.QuantWrapper(GlobalPoolBranch(make()).eval())
    x, models = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(0)), {}
    with pytest.warns(UserWarning, match=rf"qplug: backend 'fbgemm' runs 1 module\(s\) in float between a "
                                         rf"dequantize and a quantize .*: module 'module\.up': {reason}"):
        for backend in ("fbgemm", "reference"):
            observed = qp.eager.prepare(float_model, backend=backend)
            with torch.no_grad():
                observed(x)
            models[backend] = qp.eager.convert(observed)
    with torch.no_grad():  # on the calibration batch: a global pool's range differs much between images
        expected = models["reference"](x)
        assert float((models["fbgemm"](x) - expected).abs().max()) <= 4 * 2 * float(expected.abs().max()) / 255
