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


def test_prepare_fx_generates_the_graph_code_twice_and_lints_it_three_times(monkeypatch):
    """Regenerating and compiling forward's Python costs ~0.15 s per 5,600 nodes, linting ~0.02 s:
    prepare does each only where a step needs it. Code: once when tracing builds the GraphModule,
    once after observers are inserted (fusion's stage used to recompile too, for nothing: the
    observer stage runs the graph through an Interpreter, never through ``forward``). Lint: before
    each of the two pass runs and once when fusion removes the dead nodes (fusion used to lint again
    right after that)."""
    counts = {"recompile": 0, "lint": 0}
    for owner, name in ((torch.fx.GraphModule, "recompile"), (torch.fx.Graph, "lint")):
        original = getattr(owner, name)

        def counted(self, *args, __original=original, __name=name, **kwargs):
            counts[__name] += 1
            return __original(self, *args, **kwargs)
        monkeypatch.setattr(owner, name, counted)
    torch.manual_seed(0)
    model, inputs = nn.Sequential(*(_Block() for _ in range(3))).eval(), (torch.randn(1, 4, 4, 4),)
    prepared = qp.prepare_fx(model, None, inputs, backend="fbgemm")
    assert counts == {"recompile": 2, "lint": 3}
    # the code that runs is the observed graph's: calibrating goes through every observer
    observers = [m for n, m in prepared.named_modules() if "activation_post_process" in n]
    prepared(*inputs)
    assert observers and all(o.has_data for o in observers)
