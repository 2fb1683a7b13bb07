"""Per-call cost of small int8 models: where int8 beats float and where the call overhead wins.

Run: ``python bench/bench_call_overhead.py [--models mlp digits_cnn small_cnn mlp_256] [--batches 1 16]
[--backends fbgemm onnxruntime] [--rounds 1000] [--inner 1] [--threads 1] [--profile]``

Models (random init, eval, calibrated on 8 batches of their input): ``mlp`` Linear 32-64-64-10 with
ReLUs; ``digits_cnn`` the zoo's 8x8 digits CNN; ``small_cnn`` conv 3-16-32 (3x3, ReLU) + max-pool +
Linear on 3x32x32; on request ``mlp_128`` / ``mlp_256`` / ``mlp_512``, the MLP at that width (input
and hidden), to find where int8 starts to pay. Each is quantized with ``qp.quantize`` on every
backend asked for, then float and the int8 models are called round-robin in a rotating order
(``inner`` calls back to back per variant per round, ``torch.inference_mode``), so machine noise
hits them alike; one call per sample by default, as a process descheduled for 20 ms inside a block
of calls ruins that block's mean on a loaded machine while the median of single calls holds. The
table gives median us per call and the ratio int8 / float (below 1: int8 is faster). ``--profile``
prints the cProfile top of the int8 calls at batch 1, for the first backend.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
from typing import Callable

import torch
from _harness import interleaved, machine_line, median, quiet, table
from torch import nn

import qplug_core as qp
from qplug_core.zoo import example_inputs, get_model


def mlp(width: int = 64, features: int = 32) -> tuple[nn.Module, Callable[[int, int], torch.Tensor]]:
    model = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))
    return model, lambda batch, seed: torch.randn(batch, features, generator=torch.Generator().manual_seed(seed))


def digits_cnn() -> tuple[nn.Module, Callable[[int, int], torch.Tensor]]:
    return get_model("digits_cnn", seed=0), lambda batch, seed: example_inputs("digits_cnn", batch, seed=seed)[0]


def small_cnn() -> tuple[nn.Module, Callable[[int, int], torch.Tensor]]:
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(4), nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    return model, lambda batch, seed: torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


MODELS = {"mlp": mlp, "digits_cnn": digits_cnn, "small_cnn": small_cnn,
          **{f"mlp_{width}": functools.partial(mlp, width, width) for width in (128, 256, 512)}}


def runner(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model(x)
    return run


def bench_model(name: str, args: argparse.Namespace) -> list[list[str]]:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()
    calibration = [(inputs(8, seed),) for seed in range(8)]
    with quiet():
        int8 = {backend: qp.quantize(model, calibration[0], calibration, backend=backend)
                for backend in args.backends}
    rows = []
    for batch in args.batches:
        x = inputs(batch, 1000)
        variants = {"float": runner(model, x)} | {b: runner(m, x) for b, m in int8.items()}
        samples = interleaved(variants, args.rounds, warmup=5, inner=args.inner)
        float_us = median(samples["float"]) * 1e6
        row = [name, str(batch), f"{float_us:.1f}"]
        for backend in args.backends:
            us = median(samples[backend]) * 1e6
            row += [f"{us:.1f}", f"{us / float_us:.2f}x"]
        rows.append(row)
    if args.profile:
        profile(name, int8[args.backends[0]], inputs(1, 1000))
    return rows


def profile(name: str, model: nn.Module, x: torch.Tensor, calls: int = 2000) -> None:
    profiler = cProfile.Profile()
    with torch.inference_mode():
        profiler.enable()
        for _ in range(calls):
            model(x)
        profiler.disable()
    print(f"\ncProfile of {calls} int8 calls of {name} at batch 1 (tottime)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "digits_cnn", "small_cnn"], choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--backends", nargs="+", default=["fbgemm", "onnxruntime"])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--inner", type=int, default=1, help="calls per variant per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    rows = [row for name in args.models for row in bench_model(name, args)]
    header = ["model", "batch", "float us"]
    for backend in args.backends:
        header += [f"{backend} us", f"{backend}/float"]
    print(f"\n{args.rounds} interleaved rounds of {args.inner} calls, {torch.get_num_threads()} thread(s), "
          "median us per call")
    print(table(header, rows))
    print(f"\nload avg at end: {machine_line().rpartition('load avg ')[2]}")


if __name__ == "__main__":
    main()
