"""Weight-only quantization of real all-MiniLM-L6-v2 weights: the sentence embeddings users see
(mean pooling + L2 norm over tests/data/sentences_en.txt, scored on sentences calibration never
saw). Full table with AWQ: ``bench/bench_accuracy_weight_only.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

import qplug_core as qp
from qplug_core.testing.sentence_embeddings import (
    agreement,
    embed,
    load_minilm,
    read_sentences,
    split_sentences,
    token_batches,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
SENTENCES = Path(__file__).resolve().parents[1] / "data" / "sentences_en.txt"


@pytest.fixture(scope="module")
def minilm():
    model = load_minilm()
    calibration, evaluation = split_sentences(read_sentences(SENTENCES))
    batches = token_batches(model.tokenizer, evaluation)
    return model, token_batches(model.tokenizer, calibration), batches, embed(model.model, batches)


def test_int8_per_channel_rtn_keeps_the_embeddings(minilm):
    model, _, batches, reference = minilm
    result = agreement(reference, embed(qp.quantize_weights(model.model, bits=8), batches))
    assert result.cosine_mean >= 0.999 and result.cosine_min >= 0.998, result


def test_int4_group_32_gptq_keeps_the_embeddings_where_rtn_does_not(minilm):
    model, calibration, batches, reference = minilm
    gptq = qp.quantize_weights(model.model, bits=4, group_size=32, symmetric=False, algorithm="gptq",
                               calibration=calibration)
    rtn = qp.quantize_weights(model.model, bits=4, group_size=32, symmetric=False)
    ours, baseline = agreement(reference, embed(gptq, batches)), agreement(reference, embed(rtn, batches))
    assert ours.cosine_mean >= 0.99 and ours.cosine_min >= 0.975, ours
    assert ours.cosine_mean > baseline.cosine_mean + 0.01, (ours, baseline)
