"""Config-built Hugging Face models of the families issue 30 found weak with static defaults.

Each is small (one or two stages or layers, hidden 32-128, batch 2) so a test or the bench
(``bench/bench_families.py``) quantizes it in seconds; weights are random from the config, and
inputs follow the shapes users pass. Builders for the transformer families the export path is
tested on (Wav2Vec2, T5 encoder) come from :mod:`tests.support.hf_models`.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.support.hf_models import HF_MODELS, HFCase, LastHiddenState, _tokens, build_case

__all__ = ["FAMILIES", "build_family", "family_inputs"]


def _swinv2() -> nn.Module:
    from transformers import Swinv2Config, Swinv2Model
    return Swinv2Model(Swinv2Config(image_size=32, patch_size=2, embed_dim=32, depths=[2, 2],
                                    num_heads=[2, 4], window_size=4), add_pooling_layer=False)


def _albert() -> nn.Module:
    from transformers import AlbertConfig, AlbertModel
    return AlbertModel(AlbertConfig(vocab_size=1000, embedding_size=64, hidden_size=128,
                                    num_hidden_layers=4, num_attention_heads=4,
                                    intermediate_size=512, max_position_embeddings=64),
                       add_pooling_layer=False)


def _marian() -> nn.Module:
    from transformers import MarianConfig, MarianMTModel
    config = MarianConfig(vocab_size=1000, d_model=128, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4,
                          encoder_ffn_dim=512, decoder_ffn_dim=512, max_position_embeddings=64,
                          pad_token_id=999, decoder_start_token_id=999, use_cache=False)
    return MarianMTModel(config).get_encoder()


def _resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetModel
    return ResNetModel(ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64], depths=[1, 1, 1],
                                    layer_type="basic"))


def _convnext() -> nn.Module:
    from transformers import ConvNextConfig, ConvNextModel
    return ConvNextModel(ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[2, 2],
                                        image_size=32))


def _image(batch: int, gen: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, 32, 32, generator=gen),)


FAMILIES: dict[str, HFCase] = {
    "swinv2": HFCase(_swinv2, ("pixel_values",), _image),
    "albert": HFCase(_albert, ("input_ids", "attention_mask"), _tokens),
    "marian_encoder": HFCase(_marian, ("input_ids", "attention_mask"), _tokens),
    "wav2vec2": HF_MODELS["wav2vec2"],
    "resnet": HFCase(_resnet, ("pixel_values",), _image),
    "convnext": HFCase(_convnext, ("pixel_values",), _image),
    "t5_encoder": HF_MODELS["t5_encoder"],
}
"""name -> case, for the families of issue 30's table (docs/guide/export.md)."""


def build_family(name: str, seed: int = 0) -> LastHiddenState:
    """The wrapped model ``name`` of :data:`FAMILIES`, in eval mode, weights from ``seed``."""
    return build_case(FAMILIES[name], seed)


def family_inputs(name: str, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """One batch of positional inputs for ``name``."""
    return FAMILIES[name].make_inputs(batch, torch.Generator().manual_seed(seed))
