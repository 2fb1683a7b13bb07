"""Issue 29: how much output SQNR a zoo CNN can keep at all once its input is rounded to 8 bits.

SQNR against float measures the error against the whole output. A random-init model whose output
barely depends on its input (ResNet-50: the input-dependent part is ~2% of the output's energy)
measures every noise against that sliver, so rounding the input alone to uint8, as every int8
runtime does for the first convolution, caps what any int8 model of it can reach. Per model this
prints the input-dependent share of the output energy and the SQNR (dB, against float, on
bench_runtimes.py's 16 held-out images) of the float model with only one of:

* the input rounded to uint8 on the min/max of bench_runtimes.py's 8 calibration images, or
  clipped to +-3.5 / +-3 first;
* Gaussian noise on the input, or on every parameter (relative to each tensor's mean magnitude).

    python bench/noise_floor.py [--models resnet50 resnet18 mobilenet_v2]
"""

from __future__ import annotations

import argparse
import copy

import torch
from _harness import machine_line, table
from bench_onnxruntime import images

import qplug_core as qp
from qplug_core.zoo import calibrate_batchnorm, get_model


def uint8_rounded(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``x`` on the uint8 grid spanning [low, high] (asymmetric, as an activation observer sets it)."""
    scale = (high - low) / 255
    zero_point = round(-low / scale)
    return (torch.clamp(torch.round(x / scale) + zero_point, 0, 255) - zero_point) * scale


@torch.no_grad()
def floors(name: str) -> list[list[str]]:
    torch.manual_seed(0)  # bench_runtimes.py's model and data
    model = calibrate_batchnorm(get_model(name, seed=0), images(7, 4)).eval()
    calibration, held_out = images(1, 8), images(2, 16)
    want = torch.cat([model(*x) for x in held_out])
    share = float((want - want.mean(0)).pow(2).sum() / want.pow(2).sum())
    rows = [[name, "input-dependent share of the output energy", f"{100 * share:.1f}%"]]

    def sqnr(run) -> str:
        return f"{float(qp.sqnr(want, torch.cat([run(x[0]) for x in held_out]))):.2f} dB"

    low = min(float(x[0].min()) for x in calibration)
    high = max(float(x[0].max()) for x in calibration)
    for label, (a, b) in {f"min/max [{low:.2f}, {high:.2f}]": (low, high), "+-3.5": (-3.5, 3.5),
                          "+-3": (-3.0, 3.0)}.items():
        rows.append([name, f"input rounded to uint8, {label}", sqnr(lambda x: model(uint8_rounded(x, a, b)))])
    generator = torch.Generator().manual_seed(1)
    for relative in (1e-3, 1e-2):
        rows.append([name, f"input noise {relative:g}",
                     sqnr(lambda x: model(x + torch.randn(x.shape, generator=generator) * relative))])
    for relative in (1e-3, 1e-2):
        noisy = copy.deepcopy(model)
        for parameter in noisy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * parameter.abs().mean() * relative)
        rows.append([name, f"parameter noise {relative:g}", sqnr(noisy)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "resnet18", "mobilenet_v2"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    rows = [row for name in args.models for row in floors(name)]
    print(table(["model", "float model with only", "output SQNR"], rows))


if __name__ == "__main__":
    main()
