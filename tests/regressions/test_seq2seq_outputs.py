"""Defects an encoder-decoder user found (s20/seq2seq, 2026-12-06): each test is that user's own call
on a tiny config-built Hugging Face model, with the numbers they rely on."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError
from qplug_core.flows.tags import TARGET

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")

transformers = pytest.importorskip("transformers")

VOCAB = 1000


def marian() -> Any:
    """A 2+2-layer post-norm Marian translation model with random weights."""
    torch.manual_seed(0)
    config = transformers.MarianConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128,
        pad_token_id=VOCAB - 1, decoder_start_token_id=VOCAB - 1, eos_token_id=0)
    return transformers.MarianMTModel(config).eval()


def translation_batch(seed: int) -> dict[str, torch.Tensor]:
    """Two padded sentences of 12 tokens and four decoder tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB - 5, (2, 12), generator=generator)
    mask = torch.ones(2, 12, dtype=torch.long)
    ids[1, -4:], mask[1, -4:] = VOCAB - 1, 0
    return {"input_ids": ids, "attention_mask": mask,
            "decoder_input_ids": torch.randint(5, VOCAB - 5, (2, 4), generator=generator)}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.parametrize("skip", [(), (r"model\.encoder\..*",)])
def test_w8a8_keeps_the_encoder_output_the_user_reads(skip: tuple[str, ...]) -> None:
    model = marian()
    calibration = [translation_batch(seed) for seed in range(8)]
    quantized = qp.quantize_w8a8(model, calibration, alpha=0.5, skip=skip)
    batch = translation_batch(100)
    with torch.no_grad():
        want, got = model(**batch), quantized(**batch)
        encoder_want = model.get_encoder()(batch["input_ids"], batch["attention_mask"]).last_hidden_state
        encoder_got = quantized.get_encoder()(batch["input_ids"], batch["attention_mask"]).last_hidden_state
    assert cosine(want.logits, got.logits) >= 0.999
    assert cosine(want.encoder_last_hidden_state, got.encoder_last_hidden_state) >= 0.999
    assert cosine(encoder_want, encoder_got) >= 0.999
    if skip:  # a float encoder gives float's output
        torch.testing.assert_close(encoder_got, encoder_want)


def test_the_default_target_keeps_a_seq2seq_encoder_in_static_int8() -> None:
    """The encoder's pooled outputs all sit within 3e-4 of cosine of each other: their nearest
    neighbours are ties int8 cannot order, which used to push every linear out of static int8."""
    encoder = marian().get_encoder()
    calibration = [tuple(translation_batch(seed).values())[:2] for seed in range(8)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantized = qp.quantize(encoder, calibration[0], calibration, backend="fbgemm")
    result = quantized.meta[TARGET]
    assert result.met and result.float_layers == [] and result.final.neighbours_kept == 1.0


class _LoudChannel(nn.Module):
    """One linear whose output channel 0 is 1000x the rest, scaled back after it: its static int8
    output grid rounds the other channels away, its dynamic fallback does not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 8)
        with torch.no_grad():
            self.fc.weight[0] *= 1000.0
            self.fc.bias[0] *= 1000.0
        self.register_buffer("back", torch.cat([torch.full((1,), 1e-3), torch.ones(7)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.back


def test_a_target_met_only_with_every_layer_out_of_static_int8_warns() -> None:
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=generator),) for _ in range(4)]
    with pytest.warns(UserWarning, match="met only with every weighted layer"):
        quantized = qp.quantize(_LoudChannel().eval(), data[0], data, backend="reference",
                                target=qp.Target(cosine=0.999, group="layer", fallback="dynamic"))
    assert quantized.meta[TARGET].float_layers == ["fc"]


def test_dict_inputs_on_the_graph_path_bind_and_in_compare_are_a_clear_error() -> None:
    """Calibration of the module-swap paths takes dict batches, and so does qp.quantize's graph path
    (bound to forward()'s parameters by name); qp.compare calls the model with positional inputs and
    must say so, not fail inside the model."""
    model = marian()
    batch = translation_batch(0)
    encoder_batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    encoder = qp.quantize(model.get_encoder(), encoder_batch, [encoder_batch], backend="fbgemm")
    assert qp.quantization_report(encoder).quantized
    quantized = qp.quantize_w8a8(model, [batch])
    for data in (batch, [batch]):
        with pytest.raises(InputMismatchError, match="got a dict of keyword inputs .* positional inputs"):
            qp.compare(model, quantized, data)
    assert qp.compare(model, quantized, [tuple(batch.values())]).num_batches == 1
