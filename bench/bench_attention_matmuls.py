"""Attention matmuls (q @ kᵀ, attn @ v) in int8 on ONNX Runtime and OpenVINO, against float.

fbgemm runs them int8 (the bmm patterns); the delegates keep them float. This measures whether
either runtime would gain by taking them: at ViT shapes (batch 1, 64-wide heads, 37 tokens of a
96-px image and 197 of a 224-px one; ViT-tiny's 3 heads, ViT-base's 12), one ONNX graph per
variant, timed interleaved at one thread:

* ``float``: ``MatMul`` on the float operands, as the delegates run it now;
* ``qdq``: ``QuantizeLinear`` of both operands, ``DequantizeLinear`` -> ``MatMul`` ->
  ``QuantizeLinear`` -> ``DequantizeLinear``, the form qplug would export (its inputs come from
  linears with float outputs and its output goes to a float softmax or reshape); each runtime
  fuses it into its int8 matmul (ORT: ``QLinearMatMul``);
* ``int8 kernel``: ``QLinearMatMul`` alone on uint8 operands, the kernel with no conversion around
  it (a lower bound no partition reaches).

A ratio below 1 means int8 is faster than float.

``--block`` measures what a model gets: one ViT attention block (q/k/v/out linears, explicit
``torch.matmul`` for q @ kᵀ and attn @ v, softmax) quantized by ``qp.quantize`` on each backend,
batch 1, against fp32 eager: the defaults (attn @ v int8, q @ kᵀ float: its output feeds the
float softmax), both matmuls float (a mapping with ``torch.matmul`` at ``None``), and both int8
(``keep_isolated_ops_float=False``).

    python bench/bench_attention_matmuls.py [--rounds 30] [--inner 20] [--block base|tiny]
"""

from __future__ import annotations

import argparse

import numpy as np
from _harness import interleaved, machine_line, median, table

#: (label, heads, tokens): ViT-tiny at 96 and 224 px, ViT-base at 224 px (64-wide heads)
SHAPES = (("tiny 96px", 3, 37), ("tiny 224px", 3, 197), ("base 224px", 12, 197))
HEAD = 64


def _model(a_shape: list[int], b_shape: list[int], variant: str) -> bytes:
    from onnx import TensorProto, helper

    out_shape = [*a_shape[:-1], b_shape[-1]]
    scalars = [helper.make_tensor("s", TensorProto.FLOAT, [], [0.05]),
               helper.make_tensor("z", TensorProto.UINT8, [], [128]),
               helper.make_tensor("so", TensorProto.FLOAT, [], [0.5])]
    if variant == "float":
        nodes = [helper.make_node("MatMul", ["a", "b"], ["y"])]
    elif variant == "qdq":
        nodes = [helper.make_node("QuantizeLinear", ["a", "s", "z"], ["qa"]),
                 helper.make_node("QuantizeLinear", ["b", "s", "z"], ["qb"]),
                 helper.make_node("DequantizeLinear", ["qa", "s", "z"], ["da"]),
                 helper.make_node("DequantizeLinear", ["qb", "s", "z"], ["db"]),
                 helper.make_node("MatMul", ["da", "db"], ["m"]),
                 helper.make_node("QuantizeLinear", ["m", "so", "z"], ["qm"]),
                 helper.make_node("DequantizeLinear", ["qm", "so", "z"], ["y"])]
    else:
        nodes = [helper.make_node("QLinearMatMul", ["a", "s", "z", "b", "s", "z", "so", "z"], ["y"])]
    kind = TensorProto.UINT8 if variant == "int8 kernel" else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("a", kind, a_shape), helper.make_tensor_value_info("b", kind, b_shape)]
    output = helper.make_tensor_value_info("y", kind, out_shape)
    graph = helper.make_graph(nodes, variant, inputs, [output], scalars)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _ort(model: bytes):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)


def _openvino(model: bytes):
    import openvino

    core = openvino.Core()
    compiled = core.compile_model(core.read_model(model), "CPU", {
        "INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    return lambda feeds: request.infer(feeds)


def run(rounds: int, inner: int) -> list[list[str]]:
    rng = np.random.default_rng(0)
    rows = []
    for label, heads, tokens in SHAPES:
        for product, a_shape, b_shape in (("q@kT", [1, heads, tokens, HEAD], [1, heads, HEAD, tokens]),
                                          ("attn@v", [1, heads, tokens, tokens], [1, heads, tokens, HEAD])):
            floats = {"a": rng.standard_normal(a_shape).astype(np.float32),
                      "b": rng.standard_normal(b_shape).astype(np.float32)}
            codes = {k: rng.integers(0, 256, v.shape, dtype=np.uint8) for k, v in floats.items()}
            calls = {}
            for runtime, build in (("onnxruntime", _ort), ("openvino", _openvino)):
                for variant in ("float", "qdq", "int8 kernel"):
                    session = build(_model(a_shape, b_shape, variant))
                    feeds = codes if variant == "int8 kernel" else floats
                    calls[(runtime, variant)] = (lambda s=session, f=feeds: s(f))
            samples = interleaved({f"{r}/{v}": call for (r, v), call in calls.items()}, rounds,
                                  warmup=3, inner=inner)
            for runtime in ("onnxruntime", "openvino"):
                base = median(samples[f"{runtime}/float"])
                rows += [[f"{label} {product} {a_shape}x{b_shape[-2:]}", runtime, variant,
                          f"{median(samples[f'{runtime}/{variant}']) * 1e6:.1f}",
                          f"{median(samples[f'{runtime}/{variant}']) / base:.2f}"]
                         for variant in ("float", "qdq", "int8 kernel")]
    return rows


def block_rows(size: str, rounds: int, backends: list[str]) -> list[list[str]]:
    import torch
    from torch import nn

    import qplug_core as qp

    hidden, heads = {"tiny": (192, 3), "base": (768, 12)}[size]

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.out = (nn.Linear(hidden, hidden) for _ in range(4))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (f(x).view(b, t, heads, HEAD).transpose(1, 2) for f in (self.q, self.k, self.v))
            attn = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * HEAD ** -0.5, dim=-1)
            return self.out(torch.matmul(attn, v).transpose(1, 2).reshape(b, t, hidden))

    torch.manual_seed(0)
    torch.set_num_threads(1)
    # the exp of the softmax makes denormals, which x86 computes ~20x slower: ORT and OpenVINO
    # flush them, so float eager does too (else "x float" measures denormals, 18 ms for 1)
    torch.set_flush_denormal(True)
    model = Attention().eval()
    batches = [(torch.randn(1, 197, hidden),) for _ in range(4)]
    x = batches[0][0]
    calls = {"float": lambda: model(x)}
    for backend in backends:
        float_matmuls = qp.get_default_qconfig_mapping(backend).set_object_type(torch.matmul, None)
        for name, options in (("default", {}), ("matmuls float", {"qconfig_mapping": float_matmuls}),
                              ("matmuls int8", {"keep_isolated_ops_float": False})):
            q = qp.quantize(model, batches[0], batches, backend=backend, recipe="none", **options)
            regions = str(qp.quantization_report(q)).splitlines()[1]
            calls[f"{backend} {name}"] = (lambda q=q: q(x))
            print(f"{backend} {name}: cosine {torch.cosine_similarity(q(x).flatten(), model(x).flatten(), 0):.5f}; {regions}")
    with torch.no_grad():
        samples = interleaved(calls, rounds, warmup=3)
    base = median(samples["float"])
    rows = []
    for name, t in samples.items():
        default = median(samples[f"{name.split()[0]} default"]) if name != "float" else median(t)
        rows.append([f"ViT-{size} attention block, 197 tokens", name, f"{median(t) * 1e3:.3f}",
                     f"{median(t) / base:.2f}", f"{median(t) / default:.2f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--block", choices=("tiny", "base"), help="time a quantized attention block instead")
    parser.add_argument("--backends", default="fbgemm,onnxruntime,openvino")
    args = parser.parse_args()
    if args.block:
        rows = block_rows(args.block, args.rounds, args.backends.split(","))
        print(machine_line())
        print(table(["model", "variant", "median ms", "x float", "x default"], rows))
        return
    rows = run(args.rounds, args.inner)
    print(machine_line())
    print(table(["matmul", "runtime", "variant", "median us", "x float"], rows))


if __name__ == "__main__":
    main()
