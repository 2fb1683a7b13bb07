"""Delegated partitions at new input shapes: what a serving user pays for a length or batch size
the model has not seen (first call), what the compiled models hold (RSS over ``--shapes`` new
shapes, the compiled models kept), and how 4 client threads share one model against serial calls
(interleaved, same total number of calls). On openvino also: the partition's dynamic model
against one compiled static for the example's shape (compile time; calls at that shape,
interleaved, process CPU time), the choice plugins/qplug_openvino/README.md documents.

A 1-D CNN ``(batch, 6, time)`` quantized at time 512 is called at batch 1 with new time lengths
160, 168, ... then with new batch sizes 2, 3, ...

    python bench/bench_delegate_shapes.py [--backend onnxruntime|openvino] [--shapes 20] [--rounds 7]
"""

from __future__ import annotations

import argparse
import threading
import time
import warnings

import torch
from _harness import interleaved, machine_line, median, rss_bytes, timed
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import CompiledPartition


class Cnn1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(6, 32, 5, padding=2), nn.ReLU(), nn.Conv1d(32, 32, 5, padding=2),
                                  nn.ReLU(), nn.Conv1d(32, 8, 1))

    def forward(self, x):
        return self.body(x)


def _signal(batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cumsum(0.1 * torch.randn(batch, 6, length, generator=g), dim=-1)


def _held(model: nn.Module) -> int:
    return sum(len(m.compiled) for m in model.modules() if isinstance(m, CompiledPartition))


def _static_against_dynamic(q: nn.Module, x: torch.Tensor, rounds: int) -> None:
    """OpenVINO: the partition's compiled (dynamic) model against the same ONNX model compiled
    with ``x``'s static shape, called on ``x`` in OpenVINO directly (no qplug around either)."""
    from qplug_openvino.runtime import import_openvino

    openvino = import_openvino()
    (partition,) = [m for m in q.modules() if isinstance(m, CompiledPartition)]
    core, properties = openvino.Core(), partition.compile_settings.properties()
    static = core.read_model(partition.sources[0])
    static.reshape({static.inputs[0]: openvino.PartialShape(list(x.shape))})
    seconds, compiled = timed(lambda: core.compile_model(static, "CPU", properties))
    requests = {"dynamic": partition.compiled_models[0].create_infer_request(),
                "static": compiled.create_infer_request()}
    array = x.numpy()
    times = interleaved({name: lambda r=r: r.infer({0: array}) for name, r in requests.items()}, rounds,
                        warmup=2, inner=50, clock=time.process_time)
    d, s = median(times["dynamic"]), median(times["static"])
    print(f"static model for {tuple(x.shape)}: compile {seconds * 1e3:.0f} ms; per call dynamic {d * 1e6:.0f} us, "
          f"static {s * 1e6:.0f} us (dynamic / static = {d / s:.2f}x, process CPU, medians of {rounds} "
          f"interleaved rounds of 50 calls)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="openvino")
    parser.add_argument("--shapes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = qp.quantize(Cnn1d().eval(), (_signal(1, 512, 0),), [(_signal(4, 512, s),) for s in range(1, 5)],
                        backend=args.backend)
    print(machine_line())
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q(_signal(1, 512, 1))
        before = rss_bytes()
        lengths = [timed(lambda n=n: q(_signal(1, 160 + 8 * n, 2)))[0] for n in range(args.shapes)]
        batches = [timed(lambda b=b: q(_signal(b, 512, 3)))[0] for b in range(2, 2 + args.shapes // 2)]
        grown = rss_bytes() - before
        print(f"{args.backend}: first call at {len(lengths)} new lengths: median {median(lengths) * 1e3:.1f} ms, "
              f"max {max(lengths) * 1e3:.1f} ms; at {len(batches)} new batch sizes: median "
              f"{median(batches) * 1e3:.1f} ms, max {max(batches) * 1e3:.1f} ms")
        print(f"RSS growth over {len(lengths) + len(batches)} new shapes: {grown / 2**20:.1f} MiB; "
              f"compiled models held: {_held(q)}")
        x = _signal(4, 512, 4)
        calls = 40

        def serial() -> None:
            for _ in range(calls):
                q(x)

        def threads() -> None:
            workers = [threading.Thread(target=lambda: [q(x) for _ in range(calls // 4)]) for _ in range(4)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()

        times = interleaved({"serial": serial, "4 threads": threads}, args.rounds)
        s, t = median(times["serial"]), median(times["4 threads"])
        print(f"{calls} calls at batch 4 x 512: serial {s * 1e3:.1f} ms, 4 threads {t * 1e3:.1f} ms "
              f"(serial / 4 threads = {s / t:.2f}x, medians of {args.rounds} interleaved rounds)")
        if args.backend == "openvino":
            _static_against_dynamic(q, _signal(1, 512, 5), args.rounds)


if __name__ == "__main__":
    main()
