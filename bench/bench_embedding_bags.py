"""EmbeddingBag models on the delegates: a DLRM-style model (4 bag tables of 3 ids per bag, sum and
mean, one with per-sample weights; bottom and top MLPs) at batch 1, 64 and 2048, 1 thread, one
interleaved run: fp32 eager vs qplug fbgemm and onnxruntime (bags exported as a Loop over the bags
before first-session reports, ~100x slower than float; as a segment sum since). Ratio = float / variant.

    python bench/bench_embedding_bags.py [--rows 1000000] [--backends fbgemm onnxruntime] [--rounds 30]
"""

from __future__ import annotations

import argparse
import logging

import torch
from _harness import interleaved, machine_line, median, quiet, table
from torch import nn

import qplug_core as qp

logging.getLogger("torch.onnx").setLevel(logging.ERROR)
BAG = 3


class Bags(nn.Module):
    def __init__(self, rows: int, dim: int = 64):
        super().__init__()
        self.rows = [rows, 50_000, 10_000, 1_000]
        self.tables = nn.ModuleList(nn.EmbeddingBag(r, dim, mode=m) for r, m in zip(self.rows, ["sum", "mean"] * 2))
        self.bottom = nn.Sequential(nn.Linear(13, 128), nn.ReLU(), nn.Linear(128, dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(5 * dim, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense, i0, o0, w0, i1, o1, i2, o2, i3, o3):
        bags = [self.tables[0](i0, o0, per_sample_weights=w0), self.tables[1](i1, o1), self.tables[2](i2, o2),
                self.tables[3](i3, o3)]
        return self.top(torch.cat([self.bottom(dense), *bags], 1))

    def inputs(self, batch: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        out = [torch.randn(batch, 13, generator=g)]
        for k, rows in enumerate(self.rows):
            out += [torch.randint(0, rows, (batch * BAG,), generator=g), torch.arange(0, batch * BAG, BAG)]
            if k == 0:
                out.append(torch.rand(batch * BAG, generator=g) + 0.5)
        return tuple(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--backends", nargs="+", default=["fbgemm", "onnxruntime"])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    torch.manual_seed(0)
    model = Bags(args.rows).eval()
    calibration = [model.inputs(64, seed) for seed in range(1, 5)]
    variants = {"float": model}
    with quiet():
        for backend in args.backends:
            variants[backend] = qp.quantize(model, calibration[0], calibration, backend=backend)
    rows = []
    for batch in (1, 64, 2048):
        x = model.inputs(batch, seed=100 + batch)
        with torch.no_grad():
            times = interleaved({name: (lambda m=m: m(*x)) for name, m in variants.items()},
                                max(3, args.rounds if batch < 2048 else args.rounds // 4), warmup=2)
        base = median(times["float"])
        rows.append([str(batch)] + [f"{median(times[n]) * 1e3:.3f} ms ({base / median(times[n]):.2f}x)" for n in variants])
    print(table(["batch", *variants], rows))


if __name__ == "__main__":
    main()
