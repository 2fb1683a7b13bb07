"""Latency of qplug's Linear/Conv2d kernels vs the bare torch.ops call vs torch.ao modules.

Interleaved rounds (each round times every variant once, in rotating order) and medians, so
drift and warm-up hit all variants alike. Run: ``python bench/bench_kernels.py [--engine qnnpack]``.
torch.ao is imported here only as a comparison point (never by runtime code).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Callable

import torch
from torch import nn

from qplug_core.kernels.base import KernelContext, TensorArg, engine_context, quiet_quantized_dtypes
from qplug_core.kernels.torch_int8 import Conv2d, Linear
from qplug_core.qparams import QParams


def qp(scale: float, zp: int, dtype: torch.dtype = torch.quint8) -> QParams:
    lo, hi = (0, 255) if dtype == torch.quint8 else (-128, 127)
    return QParams(torch.tensor(scale), torch.tensor(zp), dtype, lo, hi)


def time_per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def torch_ao_module(kind: str, mod: nn.Module, engine: str, out_scale: float, out_zp: int):
    try:
        import torch.ao.nn.quantized as nnq  # comparison only
    except ImportError:
        return None
    with warnings.catch_warnings(), engine_context(engine):
        warnings.simplefilter("ignore")
        if kind == "linear":
            q = nnq.Linear(mod.in_features, mod.out_features)
        else:
            q = nnq.Conv2d(mod.in_channels, mod.out_channels, mod.kernel_size, mod.stride,
                           mod.padding)
        w = torch.quantize_per_tensor(mod.weight.detach(), 0.01, 0, torch.qint8)
        q.set_weight_bias(w, mod.bias.detach())
        q.scale, q.zero_point = out_scale, out_zp
    return q


def bench_case(kind: str, mod: nn.Module, x_shape: tuple[int, ...], engine: str, rounds: int,
               calls: int) -> dict[str, float]:
    ctx = KernelContext(pattern=kind, module=mod, target=None, args=(TensorArg(0),),
                        input_qparams=(qp(0.02, 0),), output_qparams=qp(0.05, 128),
                        weight_qparams=qp(0.01, 0, torch.qint8), engine=engine)
    ours = (Linear if kind == "linear" else Conv2d).from_context(ctx)
    with quiet_quantized_dtypes():
        x = torch.quantize_per_tensor(torch.rand(x_shape) * 2.5, 0.02, 0, torch.quint8)
    op, packed, s, zp = ours._op, ours._packed, ours.scale, ours.zero_point
    variants: dict[str, Callable[[], object]] = {
        "qplug": lambda: ours(x),
        "torch.ops direct": lambda: op(x, packed, s, zp),
    }
    ao = torch_ao_module(kind, mod, engine, s, zp)
    if ao is not None:
        variants["torch.ao.nn.quantized"] = lambda: ao(x)
    samples: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for fn in variants.values():  # warm up (qnnpack packs lazily on the first run)
        time_per_call(fn, 5)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            samples[name].append(time_per_call(variants[name], calls))
    return {k: statistics.median(v) for k, v in samples.items()}


CASES = [
    ("linear", lambda: nn.Linear(64, 64), (1, 64)),
    ("linear", lambda: nn.Linear(256, 256), (32, 256)),
    ("linear", lambda: nn.Linear(1024, 1024), (64, 1024)),
    ("conv2d", lambda: nn.Conv2d(16, 16, 3, padding=1), (1, 16, 14, 14)),
    ("conv2d", lambda: nn.Conv2d(64, 64, 3, padding=1), (1, 64, 28, 28)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", action="append", choices=["fbgemm", "qnnpack"])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, median of {args.rounds} interleaved rounds "
          f"x {args.calls} calls (us/call)")
    for engine in args.engine or ["fbgemm", "qnnpack"]:
        for kind, make, shape in CASES:
            torch.manual_seed(0)
            res = bench_case(kind, make(), shape, engine, args.rounds, args.calls)
            direct = res["torch.ops direct"]
            cols = "  ".join(f"{k}={v:8.2f}" for k, v in res.items())
            print(f"{engine:8s} {kind:7s} x{str(shape):18s} {cols}  "
                  f"overhead={res['qplug'] - direct:+.2f}us ({(res['qplug'] / direct - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
