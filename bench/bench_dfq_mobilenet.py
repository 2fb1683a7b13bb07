"""MobileNetV2 with per-tensor weights: cross-layer equalization + bias correction vs per-channel.

Run: ``python bench/bench_dfq_mobilenet.py [--size 64] [--backends reference fbgemm]``

Two models, each the zoo's MobileNetV2 (seed 0, BatchNorm statistics re-estimated as in
``tests/numerics/test_model_sqnr.py``):

* ``zoo``: as built. Random init leaves every conv's channel ranges within ~2.5x of each other;
* ``trained-like``: the same function (float output within 1e-5) with each equalizable pair's
  channels rescaled by ``exp(N(0, 1))`` (ReLU6 clamps rescaled to match), which gives depthwise
  convs the 100x+ channel-range spread of trained MobileNets that per-tensor weights cannot hold.

For each model and backend the output SQNR (dB, vs float, 8 held-out batches) of: per-channel
weights; per-tensor weights; per-tensor + ``recipe="equalize"``; per-tensor + ``recipe="dfq"``
(equalize + bias correction).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from _harness import machine_line, quiet, table

import qplug_core as qp
from qplug_core.algorithms._layers import (
    layer_of,
    output_channels,
    scale_input_channels,
    scale_output_channels,
)
from qplug_core.algorithms.equalization import _find_pairs, _rescale_clamps
from qplug_core.config.defaults import default_qconfig_mapping
from qplug_core.zoo import calibrate_batchnorm, get_model


def _images(seed: int, n: int, size: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, size, size, generator=g),) for _ in range(n)]


def _trained_like(model: torch.nn.Module, example: tuple) -> torch.fx.GraphModule:
    """The fused model with each pair's channel ranges spread (same float function)."""
    gm = qp.fuse_fx(model, example, backend="reference")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for first, second, clamps in _find_pairs(gm, "rescale"):
            producer = layer_of(gm, first)
            spread = torch.exp(torch.randn(output_channels(producer), generator=g))
            scale_output_channels(producer, 1.0 / spread)
            scale_input_channels(layer_of(gm, second), spread)
            _rescale_clamps(gm, clamps, spread, 1)
    gm.recompile()
    return gm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--backends", nargs="+", default=["reference", "fbgemm"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    zoo = calibrate_batchnorm(get_model("mobilenet_v2", seed=0), _images(7, 2, args.size)).eval()
    calibration, held_out = _images(1, 4, args.size), _images(2, 8, args.size)
    models = {"zoo": zoo, "trained-like": _trained_like(zoo, calibration[0])}
    with torch.no_grad():
        spread = models["trained-like"](*held_out[0])
        drift = float((spread - zoo(*held_out[0])).norm() / zoo(*held_out[0]).norm())
    print(machine_line())
    print(f"MobileNetV2 {args.size}px; trained-like vs zoo float output: {drift:.1e} relative")
    variants = [("per-channel", True, "none"), ("per-tensor", False, "none"),
                ("per-tensor + equalize", False, "equalize"), ("per-tensor + dfq", False, "dfq")]
    rows = []
    for model_name, model in models.items():
        with torch.no_grad():
            want = torch.cat([zoo(*b) for b in held_out])
        for backend in args.backends:
            row = [f"{model_name} / {backend}"]
            for _, per_channel, recipe in variants:
                mapping = default_qconfig_mapping("static", per_channel=per_channel)
                with quiet():
                    qmodel = qp.quantize(copy.deepcopy(model), calibration[0], calibration,
                                         backend=backend, qconfig_mapping=mapping, recipe=recipe)
                with torch.no_grad():
                    got = torch.cat([qmodel(*b) for b in held_out])
                row.append(f"{qp.sqnr(want, got):.2f}")
            rows.append(row)
    print(table(["model / backend", *(v[0] for v in variants)], rows))
    print("output SQNR in dB against the float zoo model, 8 held-out batches of 2")


if __name__ == "__main__":
    sys.exit(main())
