"""Where the time goes: OpenVINO's per-op counters on qplug's static MiniLM and on NNCF's model.

Issue 29: real all-MiniLM-L6-v2 static (8x128 tokens) on qplug-openvino ran 2.3x OpenVINO's own
NNCF model. This compiles both with qplug-openvino's properties plus ``PERF_COUNT`` and prints,
per (layer type, executed kernel), the time per run, and how many FullyConnected layers run int8
or f32 (``runtimePrecision`` of the runtime model), so a gap can be traced to layers the accuracy
target kept float, float attention matmuls or Q/DQ pairs OpenVINO did not fuse. The target's
decisions (which layers left static int8 and why) are printed too.

    python bench/profile_openvino_minilm.py [--runs 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _harness import machine_line, median, table
from bench_runtimes import Bench, float_onnx, nncf_quantized, quantize_qplug


def _profile(model, feeds: list[np.ndarray] | dict[str, np.ndarray], threads: int, runs: int):
    """(median ms, ms per (layer type, kernel), count of FullyConnected per runtime precision)."""
    import openvino

    from qplug_openvino import CompileSettings

    properties = {**CompileSettings(num_threads=threads).properties(), "PERF_COUNT": True}
    compiled = openvino.Core().compile_model(model, "CPU", properties)
    request = compiled.create_infer_request()
    request.infer(feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        request.infer(feeds)
        times.append(time.perf_counter() - start)
    by_kernel: collections.Counter = collections.Counter()
    for info in request.profiling_info:  # the last run's counters
        if info.status == info.Status.EXECUTED:
            by_kernel[(info.node_type, info.exec_type)] += info.real_time.total_seconds() * 1e3
    linears: collections.Counter = collections.Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        if rt["layerType"].astype(str) == "FullyConnected":
            linears[rt["runtimePrecision"].astype(str)] += 1
    return median(times) * 1e3, by_kernel, linears


def _qplug_model(qmodel, batch):
    """(ONNX bytes, inputs) of the one OpenVINO partition of ``qmodel`` as called on ``batch``."""
    from qplug_openvino.compiled import OpenVinoPartition

    seen = []
    original = OpenVinoPartition.run

    def record(self, compiled, inputs):
        seen.append((self.sources[self.compiled.index(compiled)], compiled.positions, inputs))
        return original(self, compiled, inputs)

    OpenVinoPartition.run = record  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            qmodel(*batch)
    finally:
        OpenVinoPartition.run = original  # type: ignore[method-assign]
    if len(seen) != 1:
        raise SystemExit(f"expected one OpenVINO partition, the model called {len(seen)}")
    return seen[0]


def main() -> None:
    import openvino

    import qplug_openvino

    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    qplug_openvino.configure(num_threads=args.threads)
    bench = Bench("minilm", 8)
    batch = bench.held_out[0]
    qmodel = quantize_qplug(bench, "openvino")
    source, positions, inputs = _qplug_model(qmodel, batch)
    core = openvino.Core()
    ours = core.read_model(source)
    with tempfile.TemporaryDirectory() as tmp:
        nncf_model = nncf_quantized(bench, float_onnx(bench, Path(tmp)))
    profiles = {"qplug openvino": _profile(ours, [inputs[i].numpy() for i in positions], args.threads, args.runs),
                "OpenVINO + NNCF": _profile(nncf_model, [t.numpy() for t in batch], args.threads, args.runs)}
    rows = []
    for name, (total, by_kernel, linears) in profiles.items():
        rows.append([name, f"median of {args.runs} runs", f"{total:.2f}",
                     "FullyConnected: " + ", ".join(f"{n} {p}" for p, n in sorted(linears.items()))])
        rows += [[name, f"  {layer} {kernel}", f"{ms:.2f}", ""] for (layer, kernel), ms in by_kernel.most_common(8)]
    print(machine_line())
    print(table(["model", "layer type, kernel", "ms per run", ""], rows))
    result = qmodel.meta.get("qplug_target")
    for d in getattr(result, "decisions", []):
        print(f"target: {d.name} ({len(d.layers)} layers) -> {d.fallback}: {d.reason}")


if __name__ == "__main__":
    main()
