"""recipe="auto" calls a model a transformer on evidence of attention, not on a softmax or a class name.

A classifier's softmax head or a CBAM ``ChannelAttention`` made CNNs "transformers" (SmoothQuant and the
target search, 2.2x the quantize time), and a parameter share of convs made a tiny Whisper a CNN.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qplug_core.algorithms.architecture import transformer_verdict

pytestmark = pytest.mark.usefixtures("one_thread")


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv, self.norm = nn.Conv2d(dim, dim, 7, padding=3, groups=dim), nn.LayerNorm(dim)
        self.pwconv1, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pwconv2(torch.relu(self.pwconv1(self.norm(self.dwconv(x).permute(0, 2, 3, 1)))))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXtSoftmax(nn.Module):
    """The reviewer's case: patchify stem, ConvNeXt blocks, LayerNorm and a softmax classifier head."""

    def __init__(self, functional: bool = False) -> None:
        super().__init__()
        self.stem, self.blocks = nn.Conv2d(3, 16, 4, stride=4), nn.Sequential(ConvNeXtBlock(16), ConvNeXtBlock(16))
        self.norm, self.head, self.functional = nn.LayerNorm(16), nn.Linear(16, 5), functional
        self.softmax = nn.Softmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(self.blocks(self.stem(x)).mean((2, 3))))
        return torch.softmax(logits, -1) if self.functional else self.softmax(logits)


class ChannelAttention(nn.Module):
    """CBAM's channel attention: named *Attention, two Linears, no query or key."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c, c // 4), nn.Linear(c // 4, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.fc2(torch.relu(self.fc1(x.mean((2, 3))))))[:, :, None, None]


def vgg_cbam() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), ChannelAttention(16),
                         nn.Flatten(), nn.Linear(16 * 8 * 8, 64), nn.LayerNorm(64), nn.ReLU(),
                         nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 5), nn.Softmax(1))


def lenet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.LayerNorm(120), nn.ReLU(),
                         nn.Linear(120, 84), nn.LayerNorm(84), nn.ReLU(), nn.Linear(84, 10), nn.Softmax(1))


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1) / x.shape[-1] ** 0.5
        return self.proj(torch.softmax(scores, -1) @ self.v(x))


class TinyViT(nn.Module):
    """Patchify conv, two pre-norm attention blocks written by hand (softmax of q @ k^T)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 8, stride=8)
        self.norms, self.attns = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2)), nn.ModuleList(
            Attention(dim) for _ in range(2))
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x))
        return self.head(x.mean(1))


def _swinv2() -> nn.Module:
    from transformers import Swinv2Config, Swinv2ForImageClassification
    return Swinv2ForImageClassification(Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                                     num_heads=[2, 2], window_size=4, num_labels=5))


def _wav2vec2() -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2Model
    return Wav2Vec2Model(Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4))


def _whisper(d_model: int, layers: int, heads: int, mel_bins: int = 128) -> nn.Module:
    from transformers import WhisperConfig, WhisperForAudioClassification
    return WhisperForAudioClassification(WhisperConfig(
        d_model=d_model, encoder_layers=layers, decoder_layers=1, encoder_attention_heads=heads,
        decoder_attention_heads=heads, encoder_ffn_dim=4 * d_model, decoder_ffn_dim=4 * d_model, num_mel_bins=mel_bins,
        max_source_positions=50))


@pytest.mark.parametrize("build", [ConvNeXtSoftmax, lambda: ConvNeXtSoftmax(functional=True), vgg_cbam, lenet],
                         ids=["convnext_softmax_head", "convnext_torch_softmax", "vgg_cbam", "lenet_softmax"])
def test_a_cnn_with_a_softmax_head_or_channel_attention_stays_a_cnn(build):
    transformer, why = transformer_verdict(build())
    assert not transformer and "no attention" in why


@pytest.mark.parametrize("build", [TinyViT, _swinv2, _wav2vec2, lambda: _whisper(32, 2, 2), lambda: _whisper(384, 4, 6, 80)],
                         ids=["tiny_vit", "swinv2", "wav2vec2", "whisper_d32", "whisper_tiny_size"])
def test_transformers_with_conv_stems_are_transformers_at_any_size(build):
    transformer, why = transformer_verdict(build())
    assert transformer, why


@pytest.mark.parametrize("build, example, expected", [
    (lambda: ConvNeXtSoftmax(functional=True), torch.randn(1, 3, 16, 16), False),
    (lenet, torch.randn(1, 1, 32, 32), False),
    (TinyViT, torch.randn(1, 3, 16, 16), True),
], ids=["convnext_torch_softmax", "lenet_softmax", "tiny_vit"])
def test_a_module_and_its_exported_program_get_one_verdict(build, example, expected):
    model = build().eval()
    assert transformer_verdict(model)[0] is expected
    assert transformer_verdict(torch.export.export(model, (example,)))[0] is expected
