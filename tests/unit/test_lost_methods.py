"""Which methods of a model its captured graph lacks (qplug_core/flows/lost_methods.py): the model's
own, not torch's or Hugging Face's base API nor training set-up."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qplug_core.flows.lost_methods import lost_methods

transformers = pytest.importorskip("transformers")


def _graph(model: nn.Module) -> nn.Module:
    return torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.slow  # importing transformers' CLIP: about 2 s of CPU
def test_clip_loses_its_feature_methods():
    config = transformers.CLIPConfig(
        text_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "vocab_size": 50, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 16}, projection_dim=8)
    model = transformers.CLIPModel(config)
    assert lost_methods(model, _graph(model)) == ["get_text_features", "get_image_features"]


def test_base_api_and_training_setup_are_not_counted():
    config = transformers.Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, conv_dim=(8, 8), conv_kernel=(10, 3),
                                         conv_stride=(5, 2), num_conv_pos_embeddings=8,
                                         num_conv_pos_embedding_groups=2, vocab_size=12)
    model = transformers.Wav2Vec2ForCTC(config)  # freeze_feature_encoder, get_input_embeddings, save_pretrained ...
    assert lost_methods(model, _graph(model)) == []
    assert lost_methods(model, model) == []
