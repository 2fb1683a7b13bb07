"""MobileNetV2 (issue 19 item 18): SQNR against float on reference / fbgemm / qnnpack, and fbgemm
latency, with whatever qplug_core is importable (run once per code version to compare):

    python bench/sqnr_clamp_folding.py                       # this checkout
    PYTHONPATH=/path/to/other/checkout python bench/sqnr_clamp_folding.py

Same model and data as tests/numerics/test_model_sqnr.py (random-init MobileNetV2, BatchNorm
re-estimated, 64px, 4 calibration batches, 2 held-out batches), plus the 224px figure.
"""

from __future__ import annotations

import argparse
import time

import torch

import qplug_core as qp
from qplug_core.zoo import calibrate_batchnorm, get_model


def images(seed: int, n: int, size: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, size, size, generator=g),) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 224])
    parser.add_argument("--backends", nargs="+", default=["reference", "fbgemm", "qnnpack"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("qplug_core from", qp.__file__)
    for size in args.sizes:
        torch.manual_seed(0)
        model = calibrate_batchnorm(get_model("mobilenet_v2", seed=0), images(7, 2, 64)).eval()
        calibration, held_out = images(1, 4, size), images(2, 2, size)
        with torch.no_grad():
            expected = torch.cat([model(*b) for b in held_out])
        for backend in args.backends:
            qmodel = qp.quantize(model, calibration[0], calibration, backend=backend)
            with torch.no_grad():
                got = torch.cat([qmodel(*b) for b in held_out])
                start = time.perf_counter()
                for _ in range(5):
                    qmodel(*held_out[0])
                ms = (time.perf_counter() - start) / 5 * 1e3
            print(f"{size}px {backend:10s} SQNR {qp.sqnr(expected, got):6.2f} dB   {ms:7.1f} ms/batch(2)")


if __name__ == "__main__":
    main()
