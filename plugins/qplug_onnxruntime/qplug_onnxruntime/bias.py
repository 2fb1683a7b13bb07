"""A static linear's bias inside ORT's int8 matmul (``MatMulIntegerToFloat``'s bias input).

The exporter writes a linear on a 3-D input (a transformer's ``[batch, tokens, features]``) as
``MatMul`` then ``Add(bias)``. ORT's QDQ fusion turns DequantizeLinear -> MatMul into
MatMulIntegerToFloat but leaves the Add: one more float pass over the whole output per linear
(36 on MiniLM-L6, ~6 ms of its ~110 ms session at 8x128 tokens, 1 thread, Intel Xeon with
AVX-512 VNNI; ORT then fuses the bias Add before a GELU into BiasGelu, slower than GELU alone),
where ORT's own dynamic path fuses the bias into the matmul. :func:`fuse_linear_biases` writes
such a linear as one MatMulIntegerToFloat with its bias, the form that path produces; a 2-D
input is a Gemm, which ORT fuses with its bias (QGemm) already.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

_DOMAIN = "com.microsoft"


def fuse_linear_biases(model: onnx.ModelProto) -> int:
    """Rewrite each DequantizeLinear(x) -> MatMul(., Transpose(DequantizeLinear(int8 weight)))
    -> Add(bias) of ``model`` (in place) into one MatMulIntegerToFloat with the bias; returns how
    many. The bias is dequantized here as ORT's DequantizeLinear would at run time."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    constants = {i.name: i for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    fused: dict[int, onnx.NodeProto] = {}  # id of the Add -> the node replacing MatMul and Add
    for matmul in graph.node:
        found = _linear(matmul, producer, readers, constants, outputs)
        if found is None:
            continue
        activation, weight, add, bias = found
        prefix = matmul.name or matmul.output[0]
        weight_t = numpy_helper.from_array(
            np.ascontiguousarray(numpy_helper.to_array(constants[weight.input[0]]).T), f"{prefix}_weight_t")
        bias_value = numpy_helper.from_array(_dequantized(bias, constants), f"{prefix}_bias")
        graph.initializer.extend([weight_t, bias_value])
        fused[id(add)] = helper.make_node(
            "MatMulIntegerToFloat",
            [activation.input[0], weight_t.name, activation.input[1], weight.input[1],
             _input(activation, 2), _input(weight, 2), bias_value.name],
            [add.output[0]], name=f"{prefix}_with_bias", domain=_DOMAIN)
        fused[id(matmul)] = None
    if not fused:
        return 0
    nodes = [fused.get(id(node), node) for node in graph.node]
    del graph.node[:]
    graph.node.extend(_live([n for n in nodes if n is not None], outputs))
    used = {name for node in graph.node for name in node.input}
    live = [i for i in graph.initializer if i.name in used or i.name in outputs]
    del graph.initializer[:]
    graph.initializer.extend(live)
    if not any(opset.domain == _DOMAIN for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_DOMAIN, 1))
    return sum(node is not None for node in fused.values())


def _linear(matmul, producer, readers, constants, outputs):
    """(activation DequantizeLinear, weight DequantizeLinear, Add, bias) of a static linear
    whose bias Add can move into MatMulIntegerToFloat, else None."""
    if matmul.op_type != "MatMul" or matmul.output[0] in outputs:
        return None
    activation, transpose = producer.get(matmul.input[0]), producer.get(matmul.input[1])
    if not (_is(activation, "DequantizeLinear") and _is(transpose, "Transpose")
            and all(name in constants for name in activation.input[1:])):
        return None
    weight = producer.get(transpose.input[0])
    if not (_is(weight, "DequantizeLinear") and all(name in constants for name in weight.input)
            and constants[weight.input[0]].data_type == onnx.TensorProto.INT8
            and len(constants[weight.input[0]].dims) == 2
            and (_axis(weight) in (0, -2) or _size(constants[weight.input[1]]) == 1)):
        return None
    (add, *others) = readers.get(matmul.output[0], [None])
    if others or not _is(add, "Add"):
        return None
    bias = producer.get(add.input[1] if add.input[0] == matmul.output[0] else add.input[0])
    if not (_is(bias, "DequantizeLinear") and all(name in constants for name in bias.input)
            and list(constants[bias.input[0]].dims) == [constants[weight.input[0]].dims[0]]):
        return None
    return activation, weight, add, bias


def _size(tensor: onnx.TensorProto) -> int:
    return int(np.prod(tensor.dims))


def _is(node, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 1)


def _input(node: onnx.NodeProto, index: int) -> str:
    return node.input[index] if len(node.input) > index else ""


def _dequantized(node: onnx.NodeProto, constants) -> np.ndarray:
    """A constant DequantizeLinear's float32 value, computed as ORT computes it."""
    values = [numpy_helper.to_array(constants[name]) for name in node.input]
    q, scale = values[0].astype(np.int64), values[1].astype(np.float32)
    zero_point = values[2].astype(np.int64) if len(values) > 2 else np.int64(0)
    return ((q - zero_point).astype(np.float32) * scale).astype(np.float32)


def _live(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` without those whose outputs nothing reads any more (the weight's Transpose and
    DequantizeLinear, the bias's DequantizeLinear)."""
    while True:
        read = {name for node in nodes for name in node.input} | outputs
        kept = [node for node in nodes if any(out in read for out in node.output)]
        if len(kept) == len(nodes):
            return kept
        nodes = kept
