"""Transformer families compile on the onnxruntime backend, whole, with no float fallback (issue 25).

BERT, DistilBERT, RoBERTa and every model holding ``nn.MultiheadAttention`` fell back to float:
the exported graph's ``nn_module_stack`` reached torch.export (which the ONNX exporter runs on each
partition) in a form it refuses. Each family here, built small from its config class, must compile
into ORT sessions with nothing left in reference form or float, run all its matmul/conv FLOPs in
ORT, and meet the parity contract: SQNR against float within 1 dB of the reference form's. They
go through ``qp.quantize`` with its defaults, as users call it (SmoothQuant for transformers,
which captures the model and then prepares the captured graph: the path that broke the stack).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.onnx_export import reference_form
from tests.support.flops import int8_flop_share
from tests.support.hf_models import LastHiddenState, build_hf_model, hf_inputs

pytestmark = [pytest.mark.usefixtures("one_thread", "plugin_autoload"),
              pytest.mark.slow]  # ~10-25 s per family on 1 thread

_VOCAB, _TOKENS = 1000, 16
_SMALL = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, _VOCAB, (2, _TOKENS), generator=gen)
    mask = torch.ones(2, _TOKENS, dtype=torch.long)
    mask[1, _TOKENS * 3 // 4:] = 0
    return ids, mask


def _distilbert() -> nn.Module:
    from transformers import DistilBertConfig, DistilBertModel
    return DistilBertModel(DistilBertConfig(vocab_size=_VOCAB, max_position_embeddings=64, dim=128,
                                            n_layers=2, n_heads=4, hidden_dim=512))


def _roberta() -> nn.Module:
    from transformers import RobertaConfig, RobertaModel
    return RobertaModel(RobertaConfig(vocab_size=_VOCAB, max_position_embeddings=70, intermediate_size=512,
                                      **_SMALL), add_pooling_layer=False)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaModel
    return LlamaModel(LlamaConfig(vocab_size=_VOCAB, intermediate_size=256, num_key_value_heads=2,
                                  max_position_embeddings=64, use_cache=False, **_SMALL))


class EncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` (its ``nn.MultiheadAttention`` inside) as users stack it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class SelfAttention(nn.Module):
    """A projection feeding ``nn.MultiheadAttention`` directly."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return self.attn(y, y, y, need_weights=False)[0]


def _sequence(seed: int) -> tuple[torch.Tensor]:
    return (torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(seed)),)


def _family(name: str):
    """(float model, inputs of seed)"""
    if name in ("bert", "gpt2", "vit"):
        return build_hf_model(name), lambda seed: hf_inputs(name, seed=seed)
    torch.manual_seed(0)
    if name in ("distilbert", "roberta", "llama"):
        build = {"distilbert": _distilbert, "roberta": _roberta, "llama": _llama}[name]
        return LastHiddenState(build(), ("input_ids", "attention_mask")).eval(), _tokens
    return {"encoder_layer": EncoderLayer, "multihead_attention": SelfAttention}[name]().eval(), _sequence


FAMILIES = ("bert", "distilbert", "roberta", "gpt2", "vit", "llama", "encoder_layer", "multihead_attention")


def _sqnr(expected: torch.Tensor, actual: torch.Tensor) -> float:
    expected, actual = expected.double(), actual.double()
    return float(10 * torch.log10(expected.pow(2).sum() / (expected - actual).pow(2).sum()))


@functools.lru_cache(maxsize=None)
def _converted(name: str):
    model, make = _family(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ort_model = qp.quantize(model, make(0), [make(seed) for seed in (1, 2)], backend="onnxruntime")
    reference = reference_form(ort_model)  # the same calibration, rebuilt from the model's record
    qplug_warnings = [str(w.message) for w in caught if str(w.message).startswith("qplug")]
    return model, make, reference, ort_model, qplug_warnings


@pytest.mark.parametrize("name", FAMILIES)
def test_family_compiles_whole_into_ort_with_no_float_fallback(name):
    model, make, reference, ort_model, qplug_warnings = _converted(name)
    report = qp.quantization_report(ort_model)
    assert not [w for w in qplug_warnings if "compiling partition" in w], qplug_warnings
    assert report.reference == {}, report.reference  # nothing left in reference form
    outside = [s for s in report.skipped if not s.partition]
    assert outside == [], outside  # and no float op outside ORT (layer norms, softmax run in it)
    assert report.partitions and all(p["module"] == "OrtPartition" for p in report.partitions)
    assert len(report.partitions) == 1, report.partitions  # one session, no torch in between
    held_out = make(50)
    share = int8_flop_share(model, ort_model, held_out)
    assert share.share >= 0.99, (share.total, share.float_left)
    with torch.no_grad():
        expected = model(*held_out)
        ort_db, reference_db = _sqnr(expected, ort_model(*held_out)), _sqnr(expected, reference(*held_out))
    assert ort_db >= reference_db - 1.0, (ort_db, reference_db)


def _token_batch(batch: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, _VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[-1, tokens // 2:] = 0
    return ids, mask


@pytest.mark.parametrize("name", ["distilbert", "roberta"])
def test_one_session_serves_every_batch_size_and_sequence_length(name):
    """The partition is exported with symbolic batch and sequence axes: calls at other shapes than
    the example's (2x16) reuse its session, and still meet the parity contract."""
    model, _, reference, ort_model, _ = _converted(name)
    (partition,) = [m for m in ort_model.modules() if type(m).__name__ == "OrtPartition"]
    with torch.no_grad():
        for batch, tokens in ((3, 11), (5, 16), (2, 7)):
            x = _token_batch(batch, tokens, seed=60 + tokens)
            expected, got = model(*x), ort_model(*x)
            assert got.shape == (batch, tokens, 128)
            assert _sqnr(expected, got) >= _sqnr(expected, reference(*x)) - 1.0, (batch, tokens)
    assert len(partition.sessions) == 1
