"""Defects a vision-transformer user found (2026-12-07, s28/vit): each test is that user's own call.

F1: the patch-embedding conv made every ViT, Swin and CLIP "not a transformer", so ``qp.quantize``
gave it the CNN default (bias correction, no accuracy target) without saying so. F4: a call naming
an option at the value the capture used (``return_dict=True``) was refused.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.algorithms.architecture import looks_like_transformer
from qplug_core.algorithms.target import TRANSFORMER_TARGET
from qplug_core.errors import InputMismatchError
from qplug_core.zoo.mobilenet import mobilenet_v2
from qplug_core.zoo.resnet import resnet18

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=64, num_labels=5)).eval()


def _swinv2() -> nn.Module:
    from transformers import Swinv2Config, Swinv2ForImageClassification
    return Swinv2ForImageClassification(Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                                     num_heads=[2, 2], window_size=4, num_labels=5))


def _clip_vision() -> nn.Module:
    from transformers import CLIPVisionConfig, CLIPVisionModel
    return CLIPVisionModel(CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=2))


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 conv, LayerNorm, pointwise linears: LayerNorms and linears, but no attention."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1, self.act, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        return x + self.pwconv2(self.act(self.pwconv1(self.norm(y)))).permute(0, 3, 1, 2)


class ConvNeXtLike(nn.Module):
    """A patchify stem (stride = kernel) like a ViT's, then ConvNeXt blocks and a linear head."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, stride=4)
        self.blocks = nn.Sequential(ConvNeXtBlock(dim), ConvNeXtBlock(dim))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.stem(x)).mean((2, 3))))


@pytest.mark.parametrize("build", [_vit, _swinv2, _clip_vision], ids=["vit", "swinv2", "clip_vision"])
def test_a_patch_embedding_conv_does_not_make_a_vision_transformer_a_cnn(build):
    assert looks_like_transformer(build())


@pytest.mark.parametrize("build", [lambda: resnet18(10), lambda: mobilenet_v2(10), ConvNeXtLike],
                         ids=["resnet18", "mobilenet_v2", "convnext_like"])
def test_cnns_with_a_linear_head_keep_the_cnn_default(build):
    assert not looks_like_transformer(build())


@functools.lru_cache(maxsize=None)
def _quantized_vit() -> tuple[nn.Module, nn.Module, list[tuple[torch.Tensor]]]:
    model = _vit()
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 3, 32, 32, generator=gen),) for _ in range(3)]
    return model, qp.quantize(model, batches[0], batches, backend="fbgemm"), batches


def test_a_vit_gets_the_transformer_target_and_the_report_says_so():
    _, quantized, _ = _quantized_vit()
    assert quantized.meta["qplug_recipe"].name == "auto: smoothquant"
    assert quantized.meta["qplug_target"].target == TRANSFORMER_TARGET
    text = str(qp.quantization_report(quantized))
    assert "recipe: auto: smoothquant; target (cosine=0.998, min_cosine=0.995" in text
    assert "a transformer (" in text and "patchify conv" in text


def test_a_cnn_report_says_it_got_bias_correction_and_why():
    torch.manual_seed(0)
    batches = [(torch.randn(2, 3, 32, 32),) for _ in range(2)]
    quantized = qp.quantize(ConvNeXtLike().eval(), batches[0], batches, backend="fbgemm")
    assert "qplug_target" not in quantized.meta
    text = " ".join(str(qp.quantization_report(quantized)).split())
    assert "recipe: auto: bias correction, no accuracy target: not a transformer (" in text
    assert "no attention" in text


def _check_call_options(model: nn.Module, quantized: nn.Module, x: torch.Tensor) -> None:
    expected = quantized(x).logits
    same = quantized(pixel_values=x, return_dict=True, output_attentions=False, output_hidden_states=False)
    assert torch.equal(same.logits, expected)
    assert torch.equal(quantized(x, return_dict=None).logits, expected)  # None: the config's value
    with pytest.raises(InputMismatchError, match="output_hidden_states was fixed at False .* set model.config.output_hidden_states"):
        quantized(pixel_values=x, output_hidden_states=True)
    with pytest.raises(InputMismatchError, match="no input named 'pixel_value'"):
        quantized(pixel_value=x, return_dict=True)
    with torch.no_grad():
        assert torch.nn.functional.cosine_similarity(model(x).logits.flatten(), expected.flatten(), dim=0) > 0.99


def test_call_options_at_the_captured_value_are_taken_also_after_load(tmp_path):
    model, quantized, batches = _quantized_vit()
    _check_call_options(model, quantized, batches[1][0])
    qp.save(quantized, tmp_path / "vit.safetensors")
    _check_call_options(model, qp.load(tmp_path / "vit.safetensors"), batches[1][0])
