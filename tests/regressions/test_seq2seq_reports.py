"""Defects an encoder-decoder user found (2026-12-06, s20/seq2seq): each test is the user's own call on a
tiny config-built Hugging Face model, with the result or the error the user relies on."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import qplug_core as qp
from qplug_core.errors import ModelStateError
from tests.cli.cli_testkit import invoke

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")

transformers = pytest.importorskip("transformers")


def t5():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=300, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(config).eval()


def batch() -> dict[str, torch.Tensor]:
    """Two sentences, the second padded, as a tokenizer gives them."""
    ids = torch.randint(5, 295, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, -4:], mask[1, -4:] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def greedy(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=8, do_sample=False)


@pytest.mark.parametrize("options", [{"bits": 8}, {"bits": 4, "group_size": 32}])
def test_a_weight_only_t5_generates(options):
    """T5's feed-forward reads ``self.wo.weight.dtype`` in every forward: the weight-only linear shows
    the float weight it computes with (before: AttributeError 'WeightOnlyLinear' object has no attribute
    'weight' at the first forward), without keeping a float copy of it. (Any kernel: the reference one
    spares the test the others' selection benchmark.)"""
    model = t5()
    inputs = batch()
    quantized = qp.quantize_weights(model, **options, kernel="reference")
    tokens, float_tokens = greedy(quantized, inputs), greedy(model, inputs)
    agreement = (tokens == float_tokens).float().mean().item()
    assert agreement >= 0.9, f"greedy tokens equal to float's: {agreement:.0%}"
    wo, float_wo = quantized.decoder.block[1].layer[2].DenseReluDense.wo, model.decoder.block[1].layer[2].DenseReluDense.wo
    weight = wo.weight
    assert (weight.dtype, weight.shape, weight.device) == (torch.float32, float_wo.weight.shape, float_wo.weight.device)
    torch.testing.assert_close(weight + 0, wo.quantized_weight().dequantize())  # what its kernels compute with
    assert (weight - float_wo.weight).abs().max() < 0.1 * float_wo.weight.abs().max()
    assert not any(key.endswith("wo.weight") for key in quantized.state_dict())


def test_reading_a_per_token_weight_dtype_makes_no_float_copy():
    """T5 reads ``wo.weight.dtype`` three times per feed-forward call: that read is free (before, the
    per-token linear dequantized its whole weight at each read; a per-token T5 d_model 512 generated 20
    tokens in 1.6 s, 0.63 s without)."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=100, d_model=512, d_kv=64, d_ff=2048, num_layers=1,
                                   num_decoder_layers=1, num_heads=8, decoder_start_token_id=0)
    quantized = qp.quantize_dynamic(transformers.T5ForConditionalGeneration(config).eval(), backend="fbgemm",
                                    per_token=True)
    weight = quantized.encoder.block[0].layer[1].DenseReluDense.wo.weight
    make, made = weight._make, []
    weight._make = lambda: made.append(1) or make()
    assert (weight.dtype, weight.shape, weight.device.type) == (torch.float32, (512, 2048), "cpu")
    assert made == []  # metadata reads made no float copy
    assert torch.equal(weight + 0, make()) and made == [1]  # an op reading the values makes them once



@pytest.mark.parametrize("quantize", [
    lambda model, data: qp.quantize_w8a8(model, data),
    lambda model, data: qp.quantize_weights(model, calibration_data=data, algorithm="awq", kernel="reference"),
], ids=["w8a8", "awq"])
def test_batches_with_labels_calibrate_as_their_decoder_inputs(quantize, capsys):
    """A tokenized seq2seq dataset's batches carry ``labels``, which T5 shifts right into its decoder
    inputs: qplug gave them a 1-token ``decoder_input_ids`` besides, and T5's loss of 1-token logits
    against 8-token labels failed calibration. They now calibrate as the same batches with the shifted
    labels as ``decoder_input_ids`` do, and no notice says the batches have no decoder inputs."""
    labels = torch.randint(5, 295, (2, 8), generator=torch.Generator().manual_seed(2))
    shifted = {**batch(), "decoder_input_ids": torch.cat([torch.zeros(2, 1, dtype=torch.long), labels[:, :-1]], 1)}
    quantized = quantize(t5(), [{**batch(), "labels": labels}])
    assert "no decoder inputs" not in capsys.readouterr().err
    expected = quantize(t5(), [shifted])
    with torch.no_grad():
        assert torch.equal(quantized(**shifted).logits, expected(**shifted).logits)

def _quantized_models():
    calibration = [{**batch(), "decoder_input_ids": torch.tensor([[0, 7, 8], [0, 9, 10]])}]
    yield "weight-only", qp.quantize_weights(t5(), bits=8)
    yield "w8a8", qp.quantize_w8a8(t5(), calibration)
    yield "dynamic", qp.quantize_dynamic(t5(), backend="fbgemm")
    yield "dynamic (reference)", qp.quantize_dynamic(t5(), backend="reference")


def test_quantizing_a_quantized_model_again_is_refused_by_every_entry_point():
    """``quantize_weights`` refused a W8A8 model; ``quantize_dynamic`` took it silently (and swapped the
    lm_head W8A8 kept float on purpose), ``quantize_w8a8`` of a dynamic model said there was no
    nn.Linear to quantize. All three now say the model is quantized already."""
    calibration = [{**batch(), "decoder_input_ids": torch.tensor([[0, 7, 8], [0, 9, 10]])}]
    again = {"quantize_weights": lambda m: qp.quantize_weights(m, bits=8),
             "quantize_dynamic": lambda m: qp.quantize_dynamic(m, backend="fbgemm"),
             "quantize_w8a8": lambda m: qp.quantize_w8a8(m, calibration)}
    for first, model in _quantized_models():
        for name, quantize in again.items():
            with pytest.raises(ModelStateError, match=r"already quantized \(layers .*quantize the original float"):
                quantize(model)
                pytest.fail(f"{name} of a {first} model returned")


FACTORY = """
import torch
import transformers


def bart():
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=300, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, max_position_embeddings=64)
    return transformers.BartForConditionalGeneration(config).eval()
"""


def test_cli_dynamic_mode_quantizes_an_encoder_decoder(tmp_path, monkeypatch):
    """``qplug quantize --mode dynamic`` swaps a generating model's linears as ``qp.quantize_dynamic``
    does (before: it traced the whole BART and failed, "neither symbolic tracing nor torch.export can
    capture BartForConditionalGeneration"); the file loads back into the model, which generates."""
    (tmp_path / "s2smodels_cli.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        result = invoke("quantize", "s2smodels_cli:bart", "--example-shape", "2,12", "--example-shape", "2,12",
                        "--example-shape", "2,8", "--example-dtype", "int64", "--mode", "dynamic",
                        "--backend", "fbgemm", "--out", "bart.safetensors", "--json")
        assert result.exit_code == 0, result.stderr
        assert result.json()["capture"] == "module swap"
        model = sys.modules["s2smodels_cli"].bart()
        loaded = qp.load(tmp_path / "bart.safetensors", model=model)
    finally:
        sys.modules.pop("s2smodels_cli", None)
    assert type(loaded).__name__ == "BartForConditionalGeneration"
    assert greedy(loaded, batch()).shape[0] == 2
