"""Data-driven BatchNorm statistics for randomly initialised CNNs.

Fresh torchvision-style models have running mean 0 / var 1, so in eval mode BatchNorm is the
identity and activations drift by orders of magnitude (a random MobileNetV2's output is ~1e-9,
because kaiming fan_out ignores ``groups`` on depthwise convs). Trained networks keep every
layer's activations normalised; re-estimating the running statistics from a few batches restores
that property without training, which is what quantization tests on random weights need.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["calibrate_batchnorm"]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@torch.no_grad()
def calibrate_batchnorm(model: nn.Module, batches: Iterable[tuple[Any, ...]]) -> nn.Module:
    """Set every BatchNorm's running stats to the exact average over ``batches``; returns ``model``.

    Only BatchNorm layers run in train mode (dropout stays off); momentum and each module's
    train/eval mode are restored afterwards. Weights are not touched.
    """
    norms = [m for m in model.modules() if isinstance(m, _BATCH_NORMS)]
    modes = [(m, m.training) for m in model.modules()]
    momenta = [m.momentum for m in norms]
    model.eval()
    try:
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # cumulative moving average: equal weight to every batch
            m.train()
        for args in batches:
            model(*args)
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        for m, training in modes:
            m.training = training
    return model
