"""Defects a speech user found (2026-12-08, s30/asr): each test is the user's own call on a tiny
config-built Whisper, with the result or the message the user relies on."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")

transformers = pytest.importorskip("transformers")

_MELS, _FRAMES = 16, 32


def whisper():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=64, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=_MELS,
        max_source_positions=_FRAMES // 2, max_target_positions=16, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    model.generation_config.forced_decoder_ids = None
    return model


def features(seed: int) -> torch.Tensor:
    return torch.randn(1, _MELS, _FRAMES, generator=torch.Generator().manual_seed(seed))


_GEOMETRY = {nn.Conv1d: ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
                         "padding_mode"),
             nn.Linear: ("in_features", "out_features")}


def geometry(module: nn.Module, kind: type[nn.Module]) -> dict[str, object]:
    return {name: getattr(module, name) for name in _GEOMETRY[kind]}


@pytest.mark.slow  # one torch.export capture and one load
def test_whisper_generates_with_an_int8_encoder_put_back(tmp_path):
    """Whisper's ``generate()`` reads ``encoder.conv1.stride`` (before: AttributeError 'Conv1d' object has
    no attribute 'stride'); the int8 convs and linears answer the float modules' geometry, also once
    saved and loaded."""
    model = whisper()
    calibration = [features(seed) for seed in range(2)]
    encoder = qp.quantize(model.model.encoder, (calibration[0],), calibration, backend="fbgemm", recipe="none")
    path = tmp_path / "encoder.safetensors"
    qp.save(encoder, path)
    float_modules = dict(model.model.encoder.named_modules())
    for quantized in (encoder, qp.load(path)):
        swapped = {name: module for name, module in quantized.named_modules()
                   if type(module).__module__ == "qplug_core.kernels.linear_conv"}
        assert {"conv1", "conv2"} <= set(swapped)
        for name, module in swapped.items():
            kind = nn.Conv1d if isinstance(float_modules[name], nn.Conv1d) else nn.Linear
            assert geometry(module, kind) == geometry(float_modules[name], kind), name
    model.model.encoder = encoder
    with torch.no_grad():
        tokens = model.generate(features(5), max_new_tokens=4, do_sample=False)
    assert tokens.shape[0] == 1 and tokens.shape[1] >= 2


def test_quantize_gives_whisper_batches_the_decoder_start_token(capsys):
    """``qp.quantize(whisper, (features,), [features, ...])`` routed to W8A8 called ``model(features)``,
    which has no decoder input, and blamed "the model takes token ids"; the batches now get the
    decoder start token, as ``generate()`` starts the decoder, and a notice says so and that
    ``example_inputs`` are not used on that route."""
    model = whisper()
    calibration = [features(seed) for seed in range(2)]
    quantized = qp.quantize(model, (calibration[0],), calibration)
    said = capsys.readouterr().err
    assert "decoder_input_ids=[[1]] (the decoder start token)" in said
    assert "example_inputs are not used" in said
    assert quantized.qplug_w8a8.layers and type(quantized) is type(model)
    with torch.no_grad():
        tokens = quantized.generate(features(5), max_new_tokens=4, do_sample=False)
    assert tokens.shape[0] == 1 and tokens.shape[1] >= 2


def test_a_batch_whisper_cannot_take_gets_no_token_id_advice():
    """Whisper has input embeddings (its decoder's) but takes float ``input_features``: the error names
    an encoder-decoder's dict keys instead of "the model takes token ids"."""
    wrong = torch.randn(1, _MELS + 1, _FRAMES)  # one mel bin too many
    with pytest.raises(InputMismatchError) as raised:
        qp.quantize_w8a8(whisper(), [wrong])
    assert "token ids" not in str(raised.value)
    assert "is an encoder-decoder: give dicts {'input_features': ..., 'decoder_input_ids': ...}" in str(raised.value)


def test_quantize_weights_looks_for_whisper_siblings_on_the_calibration_batch():
    """Whisper's ``dummy_inputs`` are token ids, which its forward cannot take: the report showed the
    AttributeError of that run; the first calibration batch is used instead, and without one the line
    says how to help."""
    model = whisper()
    alone = qp.quantize_weights(model, bits=8, group_size=32, kernel="reference").qplug_weight_only
    assert alone.fused == []
    assert alone.fusion == ("not looked for: WhisperForConditionalGeneration's dummy_inputs (input_ids) do not "
                            "hold its main input 'input_features' and calibration is not a list of batches; pass "
                            "calibration_data=[batch] to let qplug find the layers reading one input (q/k/v)")
    helped = qp.quantize_weights(model, bits=8, group_size=32, kernel="reference",
                                 calibration_data=[features(0)]).qplug_weight_only
    assert helped.fusion == "looked for on the first calibration batch"
    attention = {f"model.encoder.layers.0.self_attn.{name}_proj" for name in "qkv"}
    assert any(attention <= set(group) for group in helped.fused), helped.fused



class FeaturesToTokens(nn.Module):
    """Whisper's forward signature, ``(input_features, attention_mask=None, decoder_input_ids=None)``,
    on two linears and a table: a whole Whisper takes 80 s to export to ONNX on the shared machine."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.tokens, self.head = nn.Linear(_MELS, 32), nn.Embedding(16, 32), nn.Linear(32, 16)

    def forward(self, input_features, attention_mask=None, decoder_input_ids=None):
        memory = self.encoder(input_features.transpose(1, 2)).mean(1, keepdim=True)
        return self.head(torch.relu(memory + self.tokens(decoder_input_ids)))


@pytest.mark.parametrize("backend, keys", [
    ("fbgemm", ("input_features", "decoder_input_ids")),  # attention_mask left at its default
    pytest.param("onnxruntime", ("decoder_input_ids", "attention_mask", "input_features"),  # in another order
                 marks=pytest.mark.slow),  # ~7 s on the shared machine: an ONNX export
])
def test_dict_batches_of_an_encoder_decoder_fit_every_backend(backend, keys):
    """Whisper's dict batches ``{"input_features", "decoder_input_ids"}`` worked on qp.quantize's W8A8
    route and were refused on the graph route a delegating backend takes ("got a dict of keyword
    inputs ... wrap it in a tuple"); they are bound to forward()'s parameters by name, whatever the
    dict's order, a parameter left out at its default."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = FeaturesToTokens().eval()
    inputs = {"decoder_input_ids": torch.tensor([[1, 5, 9, 13]]), "attention_mask": torch.ones(1, _FRAMES)}
    batches = [{key: {"input_features": features(seed), **inputs}[key] for key in keys} for seed in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a None example input makes capture='auto' export: tested elsewhere
        # the example as the user wrote it for W8A8, a dict in a 1-tuple, and bare
        example = (batches[0],) if backend == "onnxruntime" else batches[0]
        quantized = qp.quantize(model, example, batches, backend=backend, recipe="none")
    assert qp.quantization_report(quantized).quantized
    test = {"input_features": features(5), **inputs}
    with torch.no_grad():
        expected = model(**test)
        got = quantized(test["input_features"], test["attention_mask"] if "attention_mask" in keys else None,
                        test["decoder_input_ids"])
    assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.99


def test_dict_batches_from_a_dataloader_bind_as_the_same_list_does():
    """The graph route bound dict batches from a list or an iterator, but passed a DataLoader of the
    same dicts (what a Hugging Face collator gives) through and refused its batches ("got a dict of
    keyword inputs ... positional inputs"); they are bound as the loader is read, to the model a
    list of the same batches gives."""
    torch.manual_seed(0)
    model = FeaturesToTokens().eval()
    mask, ids = torch.ones(_FRAMES), torch.tensor([1, 5, 9, 13])
    examples = [{"input_features": features(seed)[0], "attention_mask": mask, "decoder_input_ids": ids}
                for seed in range(2)]
    loader = torch.utils.data.DataLoader(examples, batch_size=1)  # collated: each a dict of 1-row tensors
    batches = list(loader)
    from_loader = qp.quantize(model, batches[0], loader, backend="fbgemm", recipe="none")
    from_list = qp.quantize(model, batches[0], batches, backend="fbgemm", recipe="none")
    test = (features(5), mask[None], ids[None])
    assert qp.quantization_report(from_loader).quantized
    assert torch.equal(from_loader(*test), from_list(*test))
