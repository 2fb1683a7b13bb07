"""What a file stores for a compiled partition, and the checks on an ONNX model read from it before
a runtime builds it (``qp.load``'s stored partitions).

A runtime runs what a model names: a custom op domain loads a library's kernel, a tensor with
external data reads a file at a path the model gives. A stored partition model is data only if it
names nothing else than what qplug's exporter writes, so it must parse and pass ``onnx.checker``,
import only the standard ONNX domain and those :data:`DOMAINS` (ONNX Runtime's contrib ops, which
the onnxruntime backend's export emits), define no functions, hold every tensor inline, and take
and give as many tensors as its partition's reference form, of the dtypes it was saved for. Only
``onnx`` is imported here (not torch.onnx: the point is not to need the exporter).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

#: the stored models of a file fill at most this many times the weights they are filled from (the
#: file's reference form's; a partition's attributes, for older files' models): an honest file
#: fills each partition's weights once per input signature it was compiled for (two for a model
#: called at batch 2 and 1 before it was saved); a hostile one could name them from many models
FILL_FACTOR = 4
#: op domains qplug's exporter emits besides the standard one ("" or "ai.onnx")
DOMAINS = frozenset({"", "ai.onnx", "com.microsoft"})


@dataclass(frozen=True)
class StoredPartition:
    """The ONNX models a file stores for one partition (input signature, serialized model) and the
    runtime that compiled and checked them at save (name, version; None in files older than that
    record, or from a plugin that does not say): a first call on another version is checked again."""

    models: list[tuple[tuple, bytes]]
    runtime: tuple[str, str] | None = None


def stored_model_problem(source: bytes, partition: fx.GraphModule, signature: Sequence[tuple[Any, torch.dtype]]
                         ) -> str:
    """Why ``source`` may not be built for ``partition`` with inputs of ``signature`` ('' if it may)."""
    import onnx

    try:
        model = onnx.load_model_from_string(source)
    except Exception as exc:  # noqa: BLE001 - a DecodeError: not a model
        return _invalid(exc)
    # first: onnx.checker itself looks for a tensor's external file at the path the model gives
    if any(t.data_location == onnx.TensorProto.EXTERNAL for g in _graphs(model.graph) for t in _tensors(g)):
        return "it reads tensors from external files"
    try:
        onnx.checker.check_model(model)
    except Exception as exc:  # noqa: BLE001 - a ValidationError
        return _invalid(exc)
    named = {o.domain for o in model.opset_import} | {n.domain for g in _graphs(model.graph) for n in g.node}
    if named - DOMAINS:
        return f"it names op domains qplug's exporter does not write ({', '.join(sorted(named - DOMAINS))})"
    if len(model.functions):
        return f"it defines functions ({', '.join(f.name for f in model.functions)[:200]}), which qplug's exporter does not write"
    inputs = [n for n in partition.graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in partition.graph.nodes if n.op == "output"]
    outputs = len(output.args[0]) if isinstance(output.args[0], (tuple, list)) else 1
    if (len(model.graph.input), len(model.graph.output)) != (len(inputs), outputs) or len(signature) != len(inputs):
        return (f"it has {len(model.graph.input)} input(s) and {len(model.graph.output)} output(s) where the "
                f"partition has {len(inputs)} and {outputs}")
    wanted = [onnx.helper.np_dtype_to_tensor_dtype(torch.empty(0, dtype=dtype).numpy().dtype) for _, dtype in signature]
    given = [i.type.tensor_type.elem_type for i in model.graph.input]
    if sorted(given) != sorted(wanted):  # the exporter may order inputs otherwise; runtimes map them by name
        return f"its input types ({given}) are not the partition's ({wanted})"
    return ""


def _invalid(exc: Exception) -> str:
    return f"it is not a valid ONNX model ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"


def _graphs(graph: Any) -> Iterator[Any]:
    """``graph`` and every subgraph its nodes hold (If, Loop, Scan bodies)."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else []:
                yield from _graphs(sub)
            for sub in attribute.graphs:
                yield from _graphs(sub)


def _tensors(graph: Any) -> Iterator[Any]:
    """The tensors ``graph`` holds itself: initializers (sparse too) and node attributes."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            for sparse in [attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else []:
                yield from (sparse.values, sparse.indices)
            yield from (t for s in attribute.sparse_tensors for t in (s.values, s.indices))
