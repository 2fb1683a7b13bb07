"""Issue 30, per-family accuracy: causes found in config-built Hugging Face models, each checked
on a model small enough for seconds (the family figures: ``bench/bench_families.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp
from qplug_core.flows.pipeline import fuse_model
from qplug_core.registry.backends import get_backend

pytestmark = pytest.mark.usefixtures("plugin_autoload", "one_thread")


def _cosine(model: nn.Module, quantized: nn.Module, batches: list[tuple]) -> float:
    with torch.no_grad():
        a = torch.cat([model(*x).flatten() for x in batches]).double()
        b = torch.cat([quantized(*x).flatten() for x in batches]).double()
    return float(F.cosine_similarity(a, b, dim=0))


class _TiedLayers(nn.Module):
    """ALBERT's shape: one layer's weights used by two distinct modules, as ``torch.export``
    raises a shared layer (each later use a module of its own holding the same Parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 32)
        self.fc2.weight, self.fc2.bias = self.fc1.weight, self.fc1.bias
        with torch.no_grad():  # outlier channels after each norm: what SmoothQuant moves away
            for norm in (self.norm1, self.norm2):
                norm.weight[:4] = 30.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm2(self.fc1(self.norm1(x))))


def _batches(count: int, seed: int) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, 32, generator=gen),) for _ in range(count)]


def test_modules_holding_the_same_tensors_get_their_own_before_fusion():
    torch.manual_seed(0)
    model = _TiedLayers().eval()
    gm = fuse_model(model, get_backend("fbgemm"), _batches(1, 0)[0])
    assert gm.fc1.weight is not gm.fc2.weight and gm.fc1.bias is not gm.fc2.bias
    torch.testing.assert_close(gm.fc2.weight, model.fc1.weight, rtol=0, atol=0)
    assert model.fc2.weight is model.fc1.weight  # the user's model keeps its tie


def test_smoothquant_on_tied_layers_rescales_each_use_once():
    """SmoothQuant rescales a linear's weight columns in place; with the tensor shared by two
    uses, the second use's input scale was applied to the first's weights too (ALBERT, 4 layers:
    cosine 0.12 under qp.quantize's defaults)."""
    torch.manual_seed(0)
    model = _TiedLayers().eval()
    quantized = qp.quantize(model, _batches(1, 0)[0], _batches(4, 1), backend="fbgemm",
                            recipe="smoothquant", progress=False)
    assert _cosine(model, quantized, _batches(2, 50)) >= 0.999
    assert model.fc2.weight is model.fc1.weight


@pytest.mark.slow
def test_albert_with_defaults_keeps_cosine_0999():
    from transformers import AlbertConfig, AlbertModel

    from tests.support.hf_models import LastHiddenState, _tokens
    torch.manual_seed(0)
    config = AlbertConfig(vocab_size=1000, embedding_size=32, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=128, max_position_embeddings=32)
    model = LastHiddenState(AlbertModel(config, add_pooling_layer=False),
                            ("input_ids", "attention_mask")).eval()
    batches = [_tokens(2, torch.Generator().manual_seed(s)) for s in range(5)]
    quantized = qp.quantize(model, batches[0], batches[1:3], backend="fbgemm", progress=False)
    assert _cosine(model, quantized, batches[3:]) >= 0.999
