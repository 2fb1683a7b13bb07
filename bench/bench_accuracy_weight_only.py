"""Weight-only quantization of real all-MiniLM-L6-v2 weights: sentence-embedding agreement with fp32
(the thresholds are held by tests/e2e/test_minilm.py).

Embeddings are mean pooled over the attention mask and L2 normalised (sentence-transformers'
definition), on the odd sentences of tests/data/sentences_en.txt; the even ones calibrate AWQ and
GPTQ. Embedding tables stay float (``qp.quantize_weights``' default), linears are quantized.

    python bench/bench_accuracy_weight_only.py
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
from _harness import machine_line, table

import qplug_core as qp
from tests.support.sentence_embeddings import (
    agreement,
    embed,
    load_minilm,
    read_sentences,
    split_sentences,
    token_batches,
)

SENTENCES = Path(__file__).resolve().parents[1] / "tests" / "data" / "sentences_en.txt"
VARIANTS = [  # (label, bits, group_size, symmetric, algorithm)
    ("int8 per-channel RTN", 8, None, True, "rtn"),
    ("int8 per-channel GPTQ", 8, None, True, "gptq"),
    ("int4 g32 sym RTN", 4, 32, True, "rtn"),
    ("int4 g32 asym RTN", 4, 32, False, "rtn"),
    ("int4 g32 asym AWQ", 4, 32, False, "awq"),
    ("int4 g32 asym GPTQ", 4, 32, False, "gptq"),
    ("int4 g128 asym GPTQ", 4, 128, False, "gptq"),
]


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(machine_line())
    minilm = load_minilm()
    calibration, evaluation = split_sentences(read_sentences(SENTENCES))
    batches = token_batches(minilm.tokenizer, evaluation)
    calibration_batches = token_batches(minilm.tokenizer, calibration)
    reference = embed(minilm.model, batches)
    rows = []
    for label, bits, group_size, symmetric, algorithm in VARIANTS:
        start = time.perf_counter()
        qmodel = qp.quantize_weights(minilm.model, bits=bits, group_size=group_size, symmetric=symmetric,
                                     algorithm=algorithm,
                                     calibration_data=None if algorithm == "rtn" else calibration_batches)
        elapsed = time.perf_counter() - start
        result = agreement(reference, embed(qmodel, batches))
        rows.append([label, f"{result.cosine_mean:.4f}", f"{result.cosine_min:.4f}",
                     f"{result.neighbours_kept:.2f}", f"{elapsed:.1f}"])
    print(table(["all-MiniLM-L6-v2 weight-only", "cosine mean", "cosine min", "neighbours kept",
                 "quantize s"], rows))


if __name__ == "__main__":
    main()
