"""Defects a recommendation/tabular-model user found (2026-12-06): each test is that user's own
call, with the numbers or the error they rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.weight_only import WeightOnlyEmbeddingBag

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class PaddedBag(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(100, 8, mode=mode, padding_idx=0)
        self.fc = nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(idx, off))


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_bag_padded_only_at_serving_time_leaves_the_padding_out(backend, mode):
    """The 8-bit bag kernel ignored padding_idx: a mean bag padded at serving time was the float
    bag x real count / padded count (max error 0.15-0.18), and the contract check could not see
    it because the example and calibration bags held no padding."""
    torch.manual_seed(0)
    model = PaddedBag(mode).eval()
    with torch.no_grad():
        model.bag.weight[0].normal_()  # a loaded checkpoint's padding row need not be zero
    example = (torch.tensor([5, 6, 7, 8]), torch.tensor([0, 2]))
    calibration = [(torch.randint(1, 100, (40,)), torch.arange(0, 40, 4)) for _ in range(4)]
    int8 = qp.quantize(model, example, calibration, backend=backend)
    assert qp.quantization_report(int8).kernels["bag"] == "quantized::embedding_bag_byte"
    idx, off = torch.tensor([5, 6, 0, 0, 7, 8, 9, 0, 0, 0]), torch.tensor([0, 4, 8])  # last bag: all padding
    with torch.no_grad():
        error = (int8.bag(idx, off) - model.bag(idx, off)).abs().max()
    assert error < 0.02  # row quantization: 0.003-0.008 measured; 0.15-0.18 (mean) before


class WideAndDeep(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.user = nn.Embedding(50, 16, padding_idx=0)
        self.items = nn.EmbeddingBag(200, 16, mode=mode, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, uid: torch.Tensor, items: torch.Tensor, off: torch.Tensor,
                weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.mlp(torch.cat([self.user(uid), self.items(items, off, per_sample_weights=weights)], 1))


@pytest.mark.parametrize("bits, group_size, tolerance", [(8, None, 0.02), (4, 8, 0.3)])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_quantize_weights_takes_embedding_bags_and_saves_them(mode, bits, group_size, tolerance, tmp_path):
    """quantize_weights(embeddings=True) left every nn.EmbeddingBag float (the largest tables of a
    recommender: 640 KB kept of 785 KB) and listed none of them in ``skipped``."""
    torch.manual_seed(0)
    model = WideAndDeep(mode).eval()
    int8 = qp.quantize_weights(model, bits=bits, group_size=group_size, embeddings=True)
    info = int8.qplug_weight_only
    assert info.layers["items"] == "embedding_bag" and info.skipped == {}
    assert isinstance(int8.items, WeightOnlyEmbeddingBag)
    uid = torch.tensor([1, 2, 0])
    items, off = torch.tensor([3, 0, 4, 0, 0, 9, 9, 199]), torch.tensor([0, 2, 5])
    weights = torch.rand(8) if mode == "sum" else None
    with torch.no_grad():
        want = model.items(items, off, per_sample_weights=weights)
        got = int8.items(items, off, per_sample_weights=weights)
        assert (got - want).abs().max() < tolerance  # 8-bit: ~0.01, 4-bit: ~0.15 measured
        assert torch.equal(int8.items(items.view(2, 4)), int8.items(items, torch.tensor([0, 4])))
        path = qp.save(int8, tmp_path / "wide.safetensors")
        loaded = qp.load(path, model=WideAndDeep(mode).eval())
        assert loaded.qplug_weight_only.layers["items"] == "embedding_bag"
        assert torch.equal(loaded(uid, items, off, weights), int8(uid, items, off, weights))


def test_quantize_weights_says_why_a_renormalised_bag_stays_float():
    model = nn.Sequential(nn.EmbeddingBag(20, 8, max_norm=1.0), nn.Linear(8, 2))
    int8 = qp.quantize_weights(model, embeddings=True)
    assert "max_norm=1.0 renormalises the rows" in int8.qplug_weight_only.skipped["0"]
    assert type(int8[0]) is nn.EmbeddingBag
