"""Issue 30: ``prepare_fx`` does the same work per block whatever the model's length.

Timing is for ``bench/bench_prepare.py``; this test counts operations instead: the Python calls
(cProfile's ``total_calls``, which counts every resumed generator step too) that ``prepare_fx``
makes on chains of conv-bn-relu + add-relu blocks. Linear work means each extra block costs the
same number of calls on a long chain as on a short one. Before the fix, fusion's clean-up ran one
``any()`` over the graph per fused-away module (6 million steps at 800 blocks): the calls per
extra block grew by 18% from the 10..40 to the 40..160 range.
"""

from __future__ import annotations

import cProfile
import pstats

import pytest
import torch
from torch import nn

import qplug_core as qp

pytestmark = pytest.mark.usefixtures("plugin_autoload", "one_thread")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()
        self.conv2, self.bn2, self.relu2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))) + x)


def _calls(blocks: int) -> int:
    torch.manual_seed(0)
    model, inputs = nn.Sequential(*(_Block() for _ in range(blocks))).eval(), (torch.randn(1, 4, 4, 4),)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        qp.prepare_fx(model, None, inputs, backend="fbgemm")
    finally:
        profiler.disable()
    return pstats.Stats(profiler).total_calls


def test_prepare_fx_calls_per_block_do_not_grow_with_the_chain():
    _calls(2)  # plugin discovery, pattern tables and other one-time work
    short, mid, long = _calls(10), _calls(40), _calls(160)
    per_block_short = (mid - short) / 30
    per_block_long = (long - mid) / 120
    assert per_block_long <= 1.03 * per_block_short, (short, mid, long)
