"""Weight-only embedding tables of recommendation models: tables alone, and fused bag lookups.

A DLRM (four ``EmbeddingBag``s: 1M x 64 sum with per-sample weights, 50k mean, 10k sum, 1k mean,
bags of 3; 13-256-128-64 bottom and top MLPs) and a Wide&Deep (four ``nn.Embedding``s 200k..100
x 32, an MLP), random init. Per bits: ``qp.quantize_weights(embeddings=True)`` (linears too),
the tables alone on the dequantize-then-``F.embedding_bag`` path (the path before fused bags;
forced with ``fused_table() -> None``) and the tables alone with fused bags (``linears=False``).
Interleaved medians, 1 thread; ratio float/variant (> 1: faster).

    python bench/bench_weight_only_tables.py [--models dlrm widedeep] [--batches 1 64 2048] [--rounds 20]
"""

from __future__ import annotations

import warnings

import torch
from _harness import interleaved, median, run_models
from torch import nn

import qplug_core as qp
from qplug_core.weight_only import WeightOnlyEmbeddingBag


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DLRM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = [1_000_000, 50_000, 10_000, 1_000]
        self.tables = nn.ModuleList(nn.EmbeddingBag(r, 64, mode=m) for r, m in zip(self.rows, ["sum", "mean"] * 2))
        for table in self.tables:
            nn.init.uniform_(table.weight, -0.05, 0.05)
        self.bot, self.top = _mlp([13, 256, 128, 64]), _mlp([64 + 10, 256, 64, 1])
        self.tri = torch.tril_indices(5, 5, -1)

    def forward(self, dense, weights, *bags):
        x = self.bot(dense)
        rows = [t(ids, offsets, per_sample_weights=weights if k == 0 else None)
                for k, (t, ids, offsets) in enumerate(zip(self.tables, bags[0::2], bags[1::2]))]
        t = torch.stack([x, *rows], dim=1)
        return self.top(torch.cat([x, torch.bmm(t, t.transpose(1, 2))[:, self.tri[0], self.tri[1]]], dim=1))

    def inputs(self, batch: int) -> tuple:
        g = torch.Generator().manual_seed(batch)
        bags: list[torch.Tensor] = []
        for rows in self.rows:
            bags += [torch.randint(0, rows, (3 * batch,), generator=g), torch.arange(0, 3 * batch, 3)]
        return (torch.randn(batch, 13, generator=g), torch.rand(3 * batch, generator=g) + 0.5, *bags)


class WideDeep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = [200_000, 10_000, 1000, 100]
        self.embs = nn.ModuleList(nn.Embedding(r, 32) for r in self.rows)
        self.wide, self.deep = nn.Linear(20, 1), _mlp([4 * 32 + 20, 512, 256, 1])

    def forward(self, dense, *ids):
        return self.wide(dense) + self.deep(torch.cat([e(i) for e, i in zip(self.embs, ids)] + [dense], dim=1))

    def inputs(self, batch: int) -> tuple:
        g = torch.Generator().manual_seed(batch)
        return (torch.randn(batch, 20, generator=g), *(torch.randint(0, r, (batch,), generator=g) for r in self.rows))


def _dequantizing(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, WeightOnlyEmbeddingBag):
            module.fused_table = lambda: None
    return model


def run(name: str, batches: list[int], rounds: int) -> list[list[str]]:
    torch.manual_seed(0)
    model = {"dlrm": DLRM, "widedeep": WideDeep}[name]().eval()
    variants = {"float": model}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the linears' "slower than float" warning: measured here
        for bits in (8, 4):
            variants[f"int{bits} all"] = qp.quantize_weights(model, bits=bits, embeddings=True)
            variants[f"int{bits} tables, dequantize"] = _dequantizing(
                qp.quantize_weights(model, bits=bits, embeddings=True, linears=False))
            variants[f"int{bits} tables"] = qp.quantize_weights(model, bits=bits, embeddings=True, linears=False)
    rows = []
    for batch in batches:
        x = model.inputs(batch)
        with torch.no_grad():
            times = {k: median(v) for k, v in interleaved({k: (lambda m=m: m(*x)) for k, m in variants.items()},
                                                          rounds if batch < 1000 else max(3, rounds // 4)).items()}
        rows.append([name, str(batch), f"{times['float'] * 1e3:.3f} ms",
                     *(f"{times['float'] / times[k]:.2f}x" for k in list(variants)[1:])])
    return rows


if __name__ == "__main__":
    header = ["model", "batch", "float", *(f"int{b} {v}" for b in (8, 4) for v in ("all", "tables, dequantize",
                                                                                      "tables"))]
    run_models(__doc__, ["dlrm", "widedeep"], run, header)
