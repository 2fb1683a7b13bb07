"""Where an OpenVINO CPU model spends its time: per (layer type, kernel) totals of one profiled
call (``PERF_COUNT``) and the runtime precision of each op kind (``get_runtime_model()``), with
qplug-openvino's compile properties. Used for issue 29 to compare qplug's MiniLM partition (its
ONNX QDQ source, ``OpenVinoPartition.sources[0]``) with NNCF's model of the same network.

    python bench/profile_openvino_ops.py MODEL.onnx|MODEL.xml FEEDS.pkl [--threads 1]

``FEEDS.pkl``: a pickled dict of input name -> numpy array (the partition's placeholders).
"""

from __future__ import annotations

import argparse
import collections
import pickle
import time

import numpy as np

from qplug_openvino.compiled import CompileSettings
from qplug_openvino.runtime import import_openvino


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("feeds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=8)
    args = parser.parse_args()
    openvino = import_openvino()
    core = openvino.Core()
    with open(args.feeds, "rb") as f:
        arrays = pickle.load(f)  # noqa: S301 - a file this bench's user wrote
    properties = {**CompileSettings(num_threads=args.threads).properties(), "PERF_COUNT": True}
    compiled = core.compile_model(core.read_model(args.model), "CPU", properties)
    request = compiled.create_infer_request()
    feeds = {p.get_any_name(): arrays[p.get_any_name()] for p in compiled.inputs}
    times = []
    for _ in range(3 + args.calls):
        start = time.perf_counter()
        request.infer(feeds)
        times.append(time.perf_counter() - start)
    print(f"median {np.median(times[3:]) * 1e3:.1f} ms over {args.calls} calls")
    spent, count = collections.Counter(), collections.Counter()
    for info in request.profiling_info:
        if info.status == info.Status.EXECUTED:
            spent[(info.node_type, info.exec_type)] += info.real_time.total_seconds() * 1e3
            count[(info.node_type, info.exec_type)] += 1
    for (node_type, exec_type), ms in spent.most_common(20):
        print(f"  {node_type:30s} {exec_type:28s} n={count[(node_type, exec_type)]:4d} {ms:8.2f} ms")
    precisions = collections.Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        precisions[(rt["layerType"].astype(str), rt["runtimePrecision"].astype(str))] += 1
    print("runtime ops:", ", ".join(f"{t}/{p} {n}" for (t, p), n in precisions.most_common()))


if __name__ == "__main__":
    main()
