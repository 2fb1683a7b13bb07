"""Calibration on padded token batches: activation observers see the real tokens only.

A sentence batch padded to a fixed length is mostly padding; a padded token's state is read by
neither attention (masked as a key) nor the pooled output, so it must not set a per-tensor range.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.observers import HistogramObserver, MinMaxObserver


class TokenLinear(nn.Module):
    """A linear over token states, with the attention mask beside them (unused in the math)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.fc(hidden)


class OtherMaskName(TokenLinear):
    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(hidden)


def _padded_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    # 4 sentences of 3-12 real tokens padded to 32; padded positions hold a state of 50
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        lengths = torch.randint(3, 13, (4,), generator=g)
        mask = (torch.arange(32) < lengths[:, None]).long()
        hidden = torch.randn(4, 32, 8, generator=g)
        hidden[mask == 0] = 50.0
        batches.append((hidden, mask))
    return batches


def _input_range(model: nn.Module, batches, observer) -> tuple[float, float]:
    mapping = qp.QConfigMapping().set_global(qp.QConfig(
        activation=observer, weight=qp.get_default_qconfig_mapping("reference").global_qconfig.weight))
    observed = qp.prepare_fx(model.eval(), mapping, batches[0], backend="reference")
    qp.calibrate(observed, batches)
    (first,) = [m for m in observed.modules() if getattr(m, "name", None) == "input of node 'hidden'"]
    low, high = first._observed_range()
    return float(low), float(high)


@pytest.mark.parametrize("observer", [MinMaxObserver, HistogramObserver], ids=["minmax", "histogram"])
def test_padded_tokens_do_not_set_the_range(observer):
    batches = _padded_batches()
    real = torch.cat([h[m != 0] for h, m in batches])
    low, high = _input_range(TokenLinear(), batches, observer)
    assert high < 10 and high <= float(real.max()) + 1e-6 and low >= float(real.min()) - 1e-6
    # the same batches to a model whose mask input has another name: every token counts
    _, high = _input_range(OtherMaskName(), batches, observer)
    assert high > 45.0


def test_unpadded_batches_observe_every_token_as_before():
    batches = [(h.clamp(max=3.0), torch.ones_like(m)) for h, m in _padded_batches()]
    low, high = _input_range(TokenLinear(), batches, MinMaxObserver)
    every = torch.cat([h for h, _ in batches])
    assert (low, high) == (float(every.min()), float(every.max()))
