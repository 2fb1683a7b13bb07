"""Small Hugging Face transformers models, built from their configs with random weights.

These are the architectures users bring (none of them traces symbolically; torch.export captures
all), sized so that a test quantizes each in seconds: hidden size 128, two layers, 16-40 tokens or
frames, and projections that dominate the matmul FLOPs as they do at full size. Each is called
the way users call it, with keyword inputs, through :class:`LastHiddenState`. Nothing is
downloaded; ``transformers`` is imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["HF_MODELS", "HFCase", "LastHiddenState", "build_case", "build_hf_model", "hf_inputs"]


class LastHiddenState(nn.Module):
    """``model(**{name: input})`` for positional inputs in ``input_names`` -> ``last_hidden_state``."""

    def __init__(self, model: nn.Module, input_names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.input_names = input_names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.input_names, inputs))).last_hidden_state


@dataclass(frozen=True)
class HFCase:
    """How to build one architecture and make inputs for it."""

    build: Callable[[], nn.Module]
    input_names: tuple[str, ...]
    make_inputs: Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]


_HIDDEN = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 512}
_VOCAB, _TOKENS = 1000, 16


def _tokens(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask whose odd rows end in padding."""
    ids = torch.randint(0, _VOCAB, (batch, _TOKENS), generator=gen)
    mask = torch.ones(batch, _TOKENS, dtype=torch.long)
    mask[1::2, _TOKENS * 3 // 4:] = 0
    return ids, mask


def _bert() -> nn.Module:
    from transformers import BertConfig, BertModel
    return BertModel(BertConfig(vocab_size=_VOCAB, max_position_embeddings=64, **_HIDDEN),
                     add_pooling_layer=False)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2Model
    return GPT2Model(GPT2Config(vocab_size=_VOCAB, n_positions=64, n_embd=128, n_layer=2, n_head=4,
                                use_cache=False, bos_token_id=0, eos_token_id=0))


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTModel
    return ViTModel(ViTConfig(image_size=32, patch_size=8, num_channels=3, **_HIDDEN),
                    add_pooling_layer=False)


def _wav2vec2() -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2Model
    return Wav2Vec2Model(Wav2Vec2Config(
        conv_dim=(64, 64, 64), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, **_HIDDEN))


def _whisper_encoder() -> nn.Module:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    return WhisperEncoder(WhisperConfig(
        d_model=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=512,
        num_mel_bins=16, max_source_positions=32))


def _t5_encoder() -> nn.Module:
    from transformers import T5Config, T5EncoderModel
    return T5EncoderModel(T5Config(vocab_size=_VOCAB, d_model=128, d_kv=32, d_ff=512, num_layers=2,
                                   num_heads=4))


HF_MODELS: dict[str, HFCase] = {
    "bert": HFCase(_bert, ("input_ids", "attention_mask"), _tokens),
    "gpt2": HFCase(_gpt2, ("input_ids", "attention_mask"), _tokens),
    "vit": HFCase(_vit, ("pixel_values",),
                  lambda batch, gen: (torch.randn(batch, 3, 32, 32, generator=gen),)),
    "wav2vec2": HFCase(_wav2vec2, ("input_values",),
                       lambda batch, gen: (torch.randn(batch, 800, generator=gen),)),
    "whisper_encoder": HFCase(_whisper_encoder, ("input_features",),
                              lambda batch, gen: (torch.randn(batch, 16, 64, generator=gen),)),
    "t5_encoder": HFCase(_t5_encoder, ("input_ids", "attention_mask"), _tokens),
}
"""name -> case, for the architectures the export path is tested and benchmarked on."""


def build_case(case: HFCase, seed: int = 0) -> LastHiddenState:
    """``case``'s model wrapped, in eval mode, weights from ``seed``."""
    torch.manual_seed(seed)
    return LastHiddenState(case.build(), case.input_names).eval()


def build_hf_model(name: str, seed: int = 0) -> LastHiddenState:
    """The wrapped model ``name`` of :data:`HF_MODELS`, in eval mode, weights from ``seed``."""
    return build_case(HF_MODELS[name], seed)


def hf_inputs(name: str, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """One batch of positional inputs for ``name`` (same shapes for every seed)."""
    return HF_MODELS[name].make_inputs(batch, torch.Generator().manual_seed(seed))
