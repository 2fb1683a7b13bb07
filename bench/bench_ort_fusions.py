"""Issue 25: ORT fusions qplug's sessions leave out (``qplug_onnxruntime.session.SLOW_FUSIONS``).

For each, the fused ORT kernel against the ops it replaces, side by side in one interleaved run,
at a transformer's shapes (MiniLM-L6: 8x128 tokens, hidden 384; and hidden 768): a ratio above 1
means the fusion makes the session slower, and it should stay in ``SLOW_FUSIONS``.

* ``SkipLayerNormFusion``: ``Add`` + ``LayerNormalization`` vs ``com.microsoft.SkipLayerNormalization``.

    python bench/bench_ort_fusions.py [--threads 1] [--rounds 50]
"""

from __future__ import annotations

import argparse

import numpy as np
from _harness import interleaved, machine_line, median, table


def _skip_layer_norm_model(shape: list[int], fused: bool) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    hidden = shape[-1]
    inits = [numpy_helper.from_array(np.ones(hidden, np.float32), "gamma"),
             numpy_helper.from_array(np.zeros(hidden, np.float32), "beta")]
    if fused:
        nodes = [helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["y"],
                                  domain="com.microsoft", epsilon=1e-12)]
    else:
        nodes = [helper.make_node("Add", ["x", "skip"], ["sum"]),
                 helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1,
                                  epsilon=1e-12)]
    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name in ("x", "skip", "y")]
    graph = helper.make_graph(nodes, "skip_layer_norm", io[:2], io[2:], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def skip_layer_norm(threads: int, rounds: int) -> list[list[str]]:
    import onnxruntime as ort

    rows = []
    for shape in ([8, 128, 384], [8, 128, 768]):
        rng = np.random.default_rng(0)
        feeds = {name: rng.standard_normal(shape).astype(np.float32) for name in ("x", "skip")}
        sessions = {}
        for name, fused in (("Add + LayerNormalization", False), ("SkipLayerNormalization", True)):
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            sessions[name] = ort.InferenceSession(_skip_layer_norm_model(shape, fused), options,
                                                  providers=["CPUExecutionProvider"])
        outputs = [s.run(None, feeds)[0] for s in sessions.values()]
        assert np.allclose(*outputs, atol=1e-4), "the fused kernel computes something else"
        samples = interleaved({name: (lambda s=s: s.run(None, feeds)) for name, s in sessions.items()},
                              rounds, warmup=3)
        base = median(samples["Add + LayerNormalization"])
        rows += [[f"SkipLayerNormFusion {shape}", str(threads), name, f"{median(t) * 1e3:.3f}",
                  f"{median(t) / base:.2f}"] for name, t in samples.items()]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    rows = skip_layer_norm(args.threads, args.rounds)
    print(machine_line())
    print(table(["fusion", "threads", "variant", "median ms", "x unfused"], rows))


if __name__ == "__main__":
    main()
