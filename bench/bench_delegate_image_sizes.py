"""A detector on a delegate at several image sizes: wall time beside CPU time per call.

An FPN detector (ResNet-style backbone, nearest-upsample FPN, shared heads: 201 MMAC at
256x256) quantized at 1x3x256x256 is called at batch 1 and sizes 160..320, 1 thread, in
interleaved rotating rounds, twice: timed by the wall clock, then by the process's CPU clock. On
the loaded shared box a call taking more than ~1.5 ms of CPU was often descheduled for the
slices of the other runnable processes (~15-20 ms at load 10-15), so its wall-clock median jumped
10x at one size while its CPU time grew with the pixels; which size jumped followed the order
the sizes were called in (first-session reports, "F11"). SQNR vs float checks each size's outputs.

    python bench/bench_delegate_image_sizes.py [--backends onnxruntime openvino] [--sizes 160 192 ...] [--rounds 15]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F
from _harness import interleaved, machine_line, median, table
from torch import nn

import qplug_core as qp


def _cbn(i: int, o: int, k: int, s: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(i, o, k, s, k // 2, bias=False), nn.BatchNorm2d(o))


class _Block(nn.Module):
    def __init__(self, i: int, o: int, s: int) -> None:
        super().__init__()
        self.c1, self.c2 = _cbn(i, o, 3, s), _cbn(o, o, 3, 1)
        self.down = nn.Identity() if s == 1 and i == o else _cbn(i, o, 1, s)

    def forward(self, x):
        return F.relu(self.c2(F.relu(self.c1(x))) + self.down(x))


class Fpn(nn.Module):
    def __init__(self, ch: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(_cbn(3, 16, 3, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1), _Block(16, 16, 1))
        self.stages = nn.ModuleList([_Block(16, 32, 2), _Block(32, 64, 2), _Block(64, 128, 2)])
        self.lat = nn.ModuleList([nn.Conv2d(w, ch, 1) for w in (32, 64, 128)])
        self.outc = nn.ModuleList([nn.Conv2d(ch, ch, 3, padding=1) for _ in range(3)])
        self.tower = nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU())
        self.cls, self.box = nn.Conv2d(ch, 24, 3, padding=1), nn.Conv2d(ch, 12, 3, padding=1)

    def forward(self, x):
        x = self.stem(x)
        c = []
        for stage in self.stages:
            x = stage(x)
            c.append(x)
        p5 = self.lat[2](c[2])
        p4 = self.lat[1](c[1]) + F.interpolate(p5, scale_factor=2, mode="nearest")
        p3 = self.lat[0](c[0]) + F.interpolate(p4, scale_factor=2, mode="nearest")
        feats = [conv(p) for conv, p in zip(self.outc, (p3, p4, p5))]
        return [self.cls(self.tower(f)) for f in feats] + [self.box(f) for f in feats]


def _image(size: int, seed: int) -> torch.Tensor:
    """Smooth structured noise normalized like an ImageNet input."""
    g = torch.Generator().manual_seed(seed)
    x = F.interpolate(torch.rand(1, 3, size // 8, size // 8, generator=g), size=(size, size), mode="bilinear")
    return (x + 0.1 * torch.randn(1, 3, size, size, generator=g) - 0.45) / 0.25


def _rows(backend: str, model: nn.Module, sizes: list[int], rounds: int) -> list[list[str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = qp.quantize(model, (_image(256, 0),), [(_image(256, s),) for s in range(1, 9)], backend=backend)
    images = {size: _image(size, size) for size in sizes}
    with torch.inference_mode():
        variants = {size: (lambda x=x: q(x)) for size, x in images.items()}
        wall = interleaved(variants, rounds)
        cpu = interleaved(variants, rounds, clock=time.process_time)
        sqnr = {size: min(float(qp.sqnr(a, b)) for a, b in zip(model(x), q(x))) for size, x in images.items()}
    rows = []
    for size in sizes:
        w, c = median(wall[size]) * 1e3, median(cpu[size]) * 1e3
        rows.append([backend, f"{size}x{size}", f"{w:.2f}", f"{c:.2f}", f"{w / c:.1f}",
                     f"{c / (size * size / 1e6):.1f}", f"{sqnr[size]:.1f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["onnxruntime", "openvino"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[160, 192, 224, 256, 288, 320])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Fpn().eval()
    print(machine_line())
    rows = [row for backend in args.backends for row in _rows(backend, model, args.sizes, args.rounds)]
    print(table(["backend", "size", "wall ms", "CPU ms", "wall/CPU", "CPU ms/Mpx", "min SQNR dB"], rows))


if __name__ == "__main__":
    main()
