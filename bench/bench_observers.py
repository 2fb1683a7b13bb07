"""Observer throughput, qplug vs torch.ao, on activation-sized tensors.

Run: python bench/bench_observers.py [--reps 7] [--shape 32 64 56 56]

For every observer, each repetition times ours and torch.ao's back to back (interleaved, so that
machine noise hits both alike) on fresh observers: ``--batches`` forward calls over tensors with
drifting ranges, then ``calculate_qparams``. The table shows the median elements/s of the forward
calls, the median time of ``calculate_qparams`` and the end-to-end speed-up (torch.ao time / ours).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Callable

import torch

from qplug_core import observers as ours

try:
    import torch.ao.quantization as tq
except ImportError:  # pragma: no cover - the comparison needs torch.ao
    tq = None

CASES: list[tuple[str, str, dict]] = [
    ("MinMaxObserver", "MinMaxObserver", {}),
    ("MovingAverageMinMaxObserver", "MovingAverageMinMaxObserver", {}),
    ("PerChannelMinMaxObserver", "PerChannelMinMaxObserver", {"ch_axis": 1}),
    ("MovingAveragePerChannelMinMaxObserver", "MovingAveragePerChannelMinMaxObserver",
     {"ch_axis": 1}),
    ("HistogramObserver", "HistogramObserver", {}),
    ("FakeQuantize", "FakeQuantize", {}),
    ("PercentileObserver", "", {}),
    ("MSEObserver", "", {}),
]


def _time_run(make: Callable[[], torch.nn.Module], batches: list[torch.Tensor]
              ) -> tuple[float, float]:
    """(seconds in forward calls, seconds in calculate_qparams) for a fresh observer."""
    module = make()
    start = time.perf_counter()
    for x in batches:
        module(x)
    middle = time.perf_counter()
    module.calculate_qparams()
    return middle - start, time.perf_counter() - middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--shape", type=int, nargs="+", default=[32, 64, 56, 56])
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(args.shape, generator=g) * (1 + 0.5 * i) + 0.1 * i
               for i in range(args.batches)]
    elements = sum(x.numel() for x in batches)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.batches} batches of {tuple(args.shape)}, median of {args.reps} interleaved reps")
    header = (f"{'observer':40} {'qplug Melem/s':>14} {'torch.ao Melem/s':>17} "
              f"{'qplug qparams ms':>17} {'torch.ao qparams ms':>20} {'speed-up':>9}")
    print(header)
    print("-" * len(header))
    for name, ref_name, kwargs in CASES:
        mine: list[tuple[float, float]] = []
        ref: list[tuple[float, float]] = []
        for rep in range(args.reps + 1):  # rep 0 warms up (allocator, thread pool) untimed
            timing = _time_run(lambda: getattr(ours, name)(**kwargs), batches)
            mine += [timing] if rep else []
            if tq is not None and ref_name:
                timing = _time_run(lambda: getattr(tq, ref_name)(**kwargs), batches)
                ref += [timing] if rep else []
        fwd = statistics.median(m[0] for m in mine)
        qpt = statistics.median(m[1] for m in mine)
        row = f"{name:40} {elements / fwd / 1e6:14.0f} "
        if ref:
            ref_fwd = statistics.median(r[0] for r in ref)
            ref_qpt = statistics.median(r[1] for r in ref)
            total = statistics.median(sum(r) for r in ref) / statistics.median(sum(m) for m in mine)
            row += (f"{elements / ref_fwd / 1e6:17.0f} {qpt * 1e3:17.2f} {ref_qpt * 1e3:20.2f} "
                    f"{total:8.2f}x")
        else:
            row += f"{'-':>17} {qpt * 1e3:17.2f} {'-':>20} {'-':>9}"
        print(row)


if __name__ == "__main__":
    main()
