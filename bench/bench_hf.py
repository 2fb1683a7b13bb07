"""Hugging Face transformers 5.x models through ``qp.quantize`` with default options (issue 13).

Run: ``python bench/bench_hf.py [--models bert gpt2 ...] [--rounds 40] [--threads 2]``

Each architecture of ``tests.support.hf_models`` (random weights from its config, hidden 128,
2 layers, batch 2, called with keyword inputs through a ``last_hidden_state`` wrapper) is quantized
with ``qp.quantize(model, example, calibration, backend="fbgemm")`` (4 calibration batches). The
table shows which capture level ``capture="auto"`` chose, the share of the float model's matmul/conv
FLOPs that run on int8 kernels (``tests.support.flops``: FlopCounterMode per module, CPU
attention included, counted as float), the output cosine vs float on 4 held-out batches, the time
``qp.quantize`` took, and float vs int8 latency measured round-robin in one run (median ms).
``wav2vec2_speech`` is Wav2Vec2 as users run it: the default 7-conv extractor (128 channels) on
1 s of speech with silences (``tests.support.speech``), where the noise input of ``wav2vec2``
has no quiet frames.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _harness import interleaved, machine_line, median, quiet, table

import qplug_core as qp
from tests.support.flops import int8_flop_share
from tests.support.hf_models import HF_MODELS, HFCase, build_case
from tests.support.speech import speech_with_silences


def _wav2vec2_7conv() -> torch.nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2Model
    return Wav2Vec2Model(Wav2Vec2Config(
        conv_dim=(128,) * 7, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=512, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4))


CASES: dict[str, HFCase] = {**HF_MODELS, "wav2vec2_speech": HFCase(
    _wav2vec2_7conv, ("input_values",),
    lambda batch, gen: (torch.stack([speech_with_silences(1.0, gen) for _ in range(batch)]),))}


def _inputs(name: str, seed: int) -> tuple[torch.Tensor, ...]:
    return CASES[name].make_inputs(2, torch.Generator().manual_seed(seed))


def _cosine(model, quantized, batches) -> float:
    with torch.no_grad():
        a = torch.cat([model(*x).flatten() for x in batches]).double()
        b = torch.cat([quantized(*x).flatten() for x in batches]).double()
    return float(F.cosine_similarity(a, b, dim=0))


def run(name: str, rounds: int) -> list[str]:
    model = build_case(CASES[name])
    example = _inputs(name, seed=0)
    calibration = [_inputs(name, seed=s) for s in range(1, 5)]
    start = time.perf_counter()
    with quiet():
        quantized = qp.quantize(model, example, calibration, backend="fbgemm", progress=False)
    seconds = time.perf_counter() - start
    share = int8_flop_share(model, quantized, example)
    cosine = _cosine(model, quantized, [_inputs(name, seed=s) for s in range(50, 54)])
    with torch.no_grad():
        samples = interleaved({"float": lambda: model(*example), "int8": lambda: quantized(*example)},
                              rounds, warmup=3)
    f_ms, q_ms = median(samples["float"]) * 1e3, median(samples["int8"]) * 1e3
    return [name, qp.quantization_report(quantized).capture, f"{share.share:.3f}",
            f"{share.total / 1e6:.1f}", f"{cosine:.5f}", f"{seconds:.1f}", f"{f_ms:.2f}",
            f"{q_ms:.2f}", f"{f_ms / q_ms:.2f}x"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    rows = [run(name, args.rounds) for name in args.models]
    print(table(["model", "capture", "int8 FLOP share", "MFLOPs", "cosine", "quantize s",
                 "float ms", "int8 ms", "speed-up"], rows))


if __name__ == "__main__":
    main()
