"""Partition models stored before a partition read its attributes inside itself.

A compiled partition's parameters, buffers and folded constants (a ViT's class token and position
table) used to be inputs of its ONNX model, fed from PyTorch at every call; they are now read
inside the partition and exported as initializers (``fuse.build_submodule(attributes_inside=True)``),
so a file saved before that stores models with more inputs than the partition now takes. Such a
model is made the one the partition exports now, from the values the file gives the partition
itself: each input named after an attribute the partition reads (the exporter names a model's
inputs after the partition's placeholders, which were those attributes' nodes) becomes an
initializer of that value, checked against the shape and dtype stored for it. So the file keeps
building its stored models instead of exporting each partition again with a warning that its
models do not fit. Only ``onnx`` is imported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx


def attributes_as_initializers(source: bytes, signature: Sequence[tuple[Any, torch.dtype]],
                               partition: fx.GraphModule) -> tuple[tuple, bytes]:
    """``source`` and its input ``signature`` with the inputs the partition now reads inside itself
    made initializers; as they are where it has none (a model saved since), or where any of them
    does not fit (then the stored-model checks name the mismatch)."""
    inputs = sum(1 for node in partition.graph.nodes if node.op == "placeholder")
    unchanged = tuple(signature), source
    if len(signature) <= inputs:  # a model saved since: nothing to parse
        return unchanged
    import onnx
    from onnx import numpy_helper

    try:
        model = onnx.load_model_from_string(source)
    except Exception:  # noqa: BLE001 - not a model: the checks say so
        return unchanged
    if len(model.graph.input) != len(signature):
        return unchanged
    attributes = {node.name: node.target for node in partition.graph.nodes if node.op == "get_attr"}
    kept, folded = [], []
    for graph_input, (shape, dtype) in zip(model.graph.input, signature):
        target = attributes.get(graph_input.name)
        if target is None:
            kept.append((graph_input, (shape, dtype)))
            continue
        value = _attribute(partition, str(target))
        if value is None or tuple(value.shape) != tuple(shape) or value.dtype != dtype or dtype == torch.bfloat16:
            return unchanged
        folded.append(numpy_helper.from_array(value.detach().contiguous().numpy(), graph_input.name))
    if len(kept) != inputs:
        return unchanged
    del model.graph.input[:]
    model.graph.input.extend(graph_input for graph_input, _ in kept)
    model.graph.initializer.extend(folded)
    return tuple(spec for _, spec in kept), model.SerializeToString()


def attribute_bytes(partition: fx.GraphModule) -> int:
    """The bytes of the tensors ``partition`` reads as attributes (what one model takes in)."""
    tensors = (_attribute(partition, str(node.target)) for node in partition.graph.nodes if node.op == "get_attr")
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _attribute(module: torch.nn.Module, target: str) -> torch.Tensor | None:
    """The tensor at the dotted ``target`` of ``module``, or None."""
    value: Any = module
    for atom in target.split("."):
        value = getattr(value, atom, None)
    return value if isinstance(value, torch.Tensor) else None


__all__ = ["attribute_bytes", "attributes_as_initializers"]
