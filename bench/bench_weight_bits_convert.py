"""Issue 24: what the per-layer weight-bits choice costs at convert, interleaved in one run.

Three converts of the same calibrated model (``convert_to_reference_fx``, 1 thread) under an AVX2
CPU's flags: no choice (the default mapping passed explicitly: 7-bit weights everywhere), the
choice on the example inputs only (the calibration sample switched off), and the choice on the
example plus the calibration batches kept (``flows/calibration_sample.py``, at most 8). Median of
``--reps`` rounds, each round running the three in turn.

    python bench/bench_weight_bits_convert.py [--model resnet18] [--batches 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from _harness import machine_line

import qplug_core as qp
from qplug_core.flows import steps
from qplug_core.kernels.cpu import override_cpu_flags
from qplug_core.zoo import calibrate_batchnorm, example_inputs, get_model

AVX2 = "fpu sse sse2 avx avx2 fma"


def observed(model, calib, mapping=None, *, sample=True):
    start = steps.calibration_sample.start
    if not sample:
        steps.calibration_sample.start = lambda gm: None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return qp.calibrate(qp.prepare_fx(model, mapping, calib[0], backend="fbgemm"), calib)
    finally:
        steps.calibration_sample.start = start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    model = get_model(args.model, seed=0).eval()
    calibrate_batchnorm(model, [example_inputs(args.model, batch=8, seed=s) for s in range(2)])
    calib = [example_inputs(args.model, batch=4, seed=10 + s) for s in range(args.batches)]
    with override_cpu_flags(AVX2):
        variants = {"no choice (7-bit everywhere)": observed(model, calib, qp.get_default_qconfig_mapping("fbgemm")),
                    "choice on the example only": observed(model, calib, sample=False),
                    f"choice on example + kept batches (of {args.batches})": observed(model, calib)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.reps):
            for name, obs in variants.items():
                begin = time.perf_counter()
                qp.convert_to_reference_fx(obs)
                times[name].append(time.perf_counter() - begin)
    base = statistics.median(next(iter(times.values())))
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:45s} {median:6.2f} s  {median / base:5.2f}x")


if __name__ == "__main__":
    main()
