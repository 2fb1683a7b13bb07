"""Two real-model failures of issue 27, on small Hugging Face models built from their configs.

* EfficientNet (every module in eval mode) failed static quantization with "needs eval-mode
  modules": its depthwise conv is a Conv2d subclass that tracing goes through;
* a reloaded DeBERTa-v2 raised "Can't detach views in-place" on its first call: its exported graph
  calls ``aten::detach_`` on a folded constant and safetensors returned tensors as views.
"""

from __future__ import annotations

import pytest
import torch

import qplug_core as qp
from tests.support.hf_models import LastHiddenState

pytestmark = pytest.mark.slow


def test_efficientnet_static_quantizes():
    from transformers import EfficientNetConfig, EfficientNetModel

    torch.manual_seed(0)
    config = EfficientNetConfig(image_size=32, width_coefficient=0.25, depth_coefficient=0.25,
                                hidden_dim=320)
    model = LastHiddenState(EfficientNetModel(config), ("pixel_values",)).eval()
    assert not any(m.training for m in model.modules())
    data = [(torch.randn(2, 3, 32, 32),) for _ in range(3)]
    quantized = qp.quantize(model, data[0], data, backend="reference")
    report = qp.quantization_report(quantized)
    assert report.fusions and report.quantized
    assert qp.sqnr(quantized(*data[0]), model(*data[0])) > 10


def test_reloaded_deberta_v2_runs_and_matches(tmp_path):
    from transformers import DebertaV2Config, DebertaV2Model

    torch.manual_seed(0)
    config = DebertaV2Config(vocab_size=1000, max_position_embeddings=64, hidden_size=64,
                             num_hidden_layers=1, num_attention_heads=4, intermediate_size=128)
    model = LastHiddenState(DebertaV2Model(config), ("input_ids", "attention_mask")).eval()
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 1000, (2, 12), generator=generator),
                torch.ones(2, 12, dtype=torch.long)) for _ in range(3)]
    quantized = qp.quantize(model, batches[0], batches, backend="reference")
    loaded = qp.load(qp.save(quantized, tmp_path / "deberta.safetensors"))
    torch.testing.assert_close(loaded(*batches[1]), quantized(*batches[1]), rtol=0, atol=0)
