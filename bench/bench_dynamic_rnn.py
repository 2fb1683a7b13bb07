"""``qp.quantize_dynamic`` LSTM / GRU vs float eager per backend (docs/guide/dynamic.md, "Speed of
recurrent layers"): a 2-layer LSTM or GRU on 40 log-mel-like features + a linear head, at batch 1
(streaming) and 8, interleaved, float / int8 median ratios (> 1: int8 faster) and cosine vs float.
qnnpack is ARM's backend (on x86 it warns); onnxruntime takes the graph route (``example_inputs=``)
and keeps GRUs float.

    taskset -c 0 python bench/bench_dynamic_rnn.py [--hidden 256 512] [--kinds lstm gru] [--rounds 30]
        [--backends fbgemm qnnpack onnxruntime] [--clock thread]

``--clock thread`` times each call in CPU seconds of the calling thread (``time.thread_time``):
exact at one thread for torch's kernels and a one-thread ONNX Runtime session, and free of the
slices other processes take on a loaded machine (wall seconds are the default).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from _harness import interleaved, machine_line, median
from torch import nn

import qplug_core as qp

SHAPES = ((1, 100), (1, 20), (8, 100))  # (batch, frames)


class Tagger(nn.Module):
    def __init__(self, kind: str, hidden: int) -> None:
        super().__init__()
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(40, hidden, 2, batch_first=True)
        self.head = nn.Linear(hidden, 30)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--kinds", nargs="+", default=["lstm", "gru"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--backends", nargs="+", default=["fbgemm", "qnnpack", "onnxruntime"])
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # qnnpack's "built for ARM" warning: the point of its column
    print(machine_line())
    for kind in args.kinds:
        for hidden in args.hidden:
            torch.manual_seed(0)
            model = Tagger(kind, hidden).eval()
            int8 = {backend: qp.quantize_dynamic(model, backend=backend)
                    for backend in args.backends if backend != "onnxruntime"}
            if kind == "lstm" and "onnxruntime" in args.backends:
                int8["onnxruntime"] = qp.quantize_dynamic(model, backend="onnxruntime",
                                                          example_inputs=(torch.randn(2, 100, 40),))
            for batch, frames in SHAPES:
                x = torch.randn(batch, frames, 40)
                with torch.inference_mode():
                    reference = model(x)
                    cosines = {name: float(nn.functional.cosine_similarity(reference.flatten(), q(x).flatten(), 0))
                               for name, q in int8.items()}
                    times = {name: median(samples) for name, samples in interleaved(
                        {"float": lambda m=model: m(x), **{n: (lambda q=q: q(x)) for n, q in int8.items()}},
                        args.rounds, warmup=3,
                        clock=time.thread_time if args.clock == "thread" else time.perf_counter).items()}
                print(f"{kind.upper()} 2x{hidden} {batch}x{frames}: float {times['float'] * 1e3:.2f} ms; " + "; ".join(
                    f"{name} {times[name] * 1e3:.2f} ms = {times['float'] / times[name]:.2f}x (cos {cosines[name]:.5f})"
                    for name in int8), flush=True)


if __name__ == "__main__":
    main()
