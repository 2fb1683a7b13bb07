"""What the default bias correction of ``qp.quantize`` gains on the zoo CNNs (accuracy, not speed).

Each model (BatchNorm re-estimated on 4 random images) is quantized with the same 8 calibration
images three ways on each backend: ``recipe="none"`` (no correction), the default
``recipe="auto"`` (bias correction measured while calibrating, channels beyond 3 standard
errors) and ``recipe="bias_correction"`` (the same pass before prepare, on the fused float model).
The figure is the output SQNR against the float model over the held-out images together (4 held
out moved MobileNetV2's figure by 0.5 dB against 32). Set ``QPLUG_CPU_FLAGS`` to decide as a CPU
without VNNI would (7-bit weights, 8 bits per layer where no int16 pair sum saturates).

    python bench/bench_bias_correction.py [--models resnet18 resnet50 mobilenet_v2]
        [--backends openvino fbgemm onnxruntime] [--held-out 32]
"""

from __future__ import annotations

import argparse
import logging

import torch
from _harness import machine_line, quiet
from bench_onnxruntime import images

import qplug_core as qp
from qplug_core.zoo import calibrate_batchnorm, get_model

RECIPES = ("none", "auto", "bias_correction")


def held_out_sqnr(model, backend: str, recipe: str, calibration, held_out, reference) -> float:
    with quiet():
        qmodel = qp.quantize(model, calibration[0], calibration, backend=backend, recipe=recipe)
    with torch.no_grad():
        outputs = torch.cat([qmodel(*x) for x in held_out])
    return float(qp.sqnr(reference, outputs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50", "mobilenet_v2"])
    parser.add_argument("--backends", nargs="+", default=["openvino", "fbgemm", "onnxruntime"])
    parser.add_argument("--held-out", type=int, default=32)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    print(machine_line())
    print(f"{'model':<14}{'backend':<13}" + "".join(f"{r:>17}" for r in RECIPES) + "   auto - none")
    for name in args.models:
        torch.manual_seed(0)
        model = calibrate_batchnorm(get_model(name, seed=0), images(7, 4)).eval()
        calibration, held_out = images(1, 8), images(2, args.held_out)
        with torch.no_grad():
            reference = torch.cat([model(*x) for x in held_out])
        for backend in args.backends:
            scores = {r: held_out_sqnr(model, backend, r, calibration, held_out, reference) for r in RECIPES}
            print(f"{name:<14}{backend:<13}" + "".join(f"{scores[r]:>17.2f}" for r in RECIPES)
                  + f"   {scores['auto'] - scores['none']:+.2f} dB", flush=True)


if __name__ == "__main__":
    main()
