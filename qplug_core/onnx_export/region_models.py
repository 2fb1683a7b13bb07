"""A delegated partition's region-by-region check model, cut from the partition's own ONNX model.

A partition of several int8 regions whose outputs are off one kernel's contract is checked region
by region (``flows/region_parity.py``): each region compiled alone, side by side in one check
graph. Exporting that graph was a second ``torch.onnx.export`` of the whole partition, and the
larger part of a delegated convert (an FPN detector on onnxruntime: 104 of the 152 s its one
partition took to compile and check, AMD EPYC Zen 4 under load). The partition's ONNX model holds
every region already. So while a partition is compiled and checked (``reusing_exports`` in
``flows/region_parity.py``), the ONNX model last exported for it is kept with the names of its
inputs, int8 values (each ``Quantize`` module is one ``qplug.quantize_per_*`` op of the exported
program, in graph order), float outputs of weighted ops (BERT's FFN output dense on onnxruntime:
the exported linear / conv whose weight is the module's) and outputs, and the check graph's model
is cut from it: each region's nodes from the values it reads to the value it writes, fed static
inputs. A region it cannot cut so (an end it has no ONNX name for, a value read from outside it)
has its check graph exported as before.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from qplug_core.flows.region_parity import partition_exports
from qplug_core.flows.tags import CHECK_REGIONS
from qplug_core.kernels.reference import Quantize, ReferenceWeighted

_QUANTIZE_OPS = ("quantize_per_tensor", "quantize_per_channel")
#: the exported ops an int8-weight module's output comes from (its weight their second argument)
_WEIGHTED_OPS = ("linear", "conv1d", "conv2d", "conv3d", "convolution")


@dataclass
class _Exported:
    """The ONNX model last exported for one GraphModule, with the ONNX name of each of its inputs
    and int8 values (fx node name -> ONNX value name), and the export options it was made with."""

    gm: fx.GraphModule
    options: Hashable
    proto: Any
    values: dict[str, str]
    #: the sizes of the inputs it was exported on, by ONNX name (a shape read from one is a constant
    #: in the check model, which runs on the same inputs' values)
    shapes: dict[str, list[int]]
    #: the ONNX type of each value with one (``value_info``, outputs, inputs), copied: the
    #: partition's model leaves its ``value_info`` out (``annotations.strip_annotations``)
    types: dict[str, Any]


def remember(gm: fx.GraphModule, example_inputs: tuple, options: Hashable, exported_program: Any, proto: Any) -> None:
    """Keep ``proto`` (exported from ``gm`` on ``example_inputs`` with ``options`` through
    ``exported_program``) for the check graphs of ``gm``, while ``reusing_exports`` is in force only."""
    exports = partition_exports()
    if exports is None or CHECK_REGIONS in gm.meta:
        return
    values = _value_names(gm, exported_program, proto)
    shapes = {values[n.name]: list(value.shape) for n, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)
              if n.name in values and isinstance(value, torch.Tensor)}
    exports[id(gm)] = _Exported(gm, options, proto, values, shapes, _value_types(proto.graph))


def cut(gm: fx.GraphModule, example_inputs: tuple, options: Hashable) -> Any:
    """The ONNX model of the check graph ``gm`` (``_side_by_side`` of ``flows/region_parity.py``)
    cut from its partition's exported model, or None where there is none to cut it from."""
    exports, regions = partition_exports(), gm.meta.get(CHECK_REGIONS)
    if exports is None or regions is None:
        return None
    source, ends = regions
    exported = exports.get(id(source))
    if exported is None or exported.gm is not source or exported.options != options:
        return None
    named = [([exported.values.get(n) for n in inputs], exported.values.get(end)) for inputs, end in ends]
    if any(end is None or None in inputs for inputs, end in named):
        return None
    return _cut(exported.proto, named, example_inputs, exported.shapes, exported.types)


def _value_types(graph: Any) -> dict[str, Any]:
    """The ONNX type of every value ``graph`` declares one for, by name (copies)."""
    import onnx

    types = {}
    for value in (*graph.value_info, *graph.output, *graph.input):
        types[value.name] = onnx.TypeProto()
        types[value.name].CopyFrom(value.type)
    return types


def _value_names(gm: fx.GraphModule, exported_program: Any, proto: Any) -> dict[str, str]:
    """fx node name -> ONNX value name of ``gm``'s inputs, ``Quantize`` outputs, weighted ops' outputs
    and outputs, as far as the exported program tells them apart (none of a kind where their counts
    differ)."""
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    initializers = {t.name for t in proto.graph.initializer}
    inputs = [i.name for i in proto.graph.input if i.name not in initializers]
    names = dict(zip(placeholders, inputs)) if len(placeholders) == len(inputs) else {}
    quantizes = [n.name for n in gm.graph.nodes
                 if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), Quantize)]
    ops = [n.name for n in exported_program.graph.nodes if n.op == "call_function"
           and getattr(n.target, "namespace", None) == "qplug" and n.target._opname in _QUANTIZE_OPS]
    produced = {out for node in proto.graph.node for out in node.output}
    if len(quantizes) == len(ops):
        names.update((node, op) for node, op in zip(quantizes, ops) if op in produced)
    names.update((node, op) for node, op in _weighted_outputs(gm, exported_program).items()
                 if op in produced and node not in names)
    returned = [n.name for n in pytree.tree_leaves(next(iter(gm.graph.find_nodes(op="output"))).args)
                if isinstance(n, fx.Node)]  # the model's outputs: a float output of a weighted op too
    if len(returned) == len(proto.graph.output) and len(set(returned)) == len(returned):
        names.update((node, output.name) for node, output in zip(returned, proto.graph.output)
                     if output.name in produced and node not in names)
    return names


def _weighted_outputs(gm: fx.GraphModule, exported_program: Any) -> dict[str, str]:
    """fx node name -> exported op name of each int8-weight module's output (a float output of a
    weighted op ends a region with no ``Quantize`` after it): the one linear / conv of the exported
    program whose weight is dequantized from that module's own weight."""
    signature = exported_program.graph_signature
    owners = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    by_module: dict[str, list[str]] = {}
    for op in exported_program.graph.nodes:
        if op.op != "call_function" or getattr(op.target, "_opname", None) not in _WEIGHTED_OPS or len(op.args) < 2:
            continue
        weight = op.args[1]
        if isinstance(weight, fx.Node) and weight.op == "call_function" and weight.args \
                and getattr(weight.target, "namespace", None) == "qplug" and isinstance(weight.args[0], fx.Node):
            owner = owners.get(weight.args[0].name, "")
            by_module.setdefault(owner.rpartition(".")[0], []).append(op.name)
    return {n.name: by_module[str(n.target)][0] for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), ReferenceWeighted)
            and len(by_module.get(str(n.target), ())) == 1}


def _cut(proto: Any, regions: list[tuple[list[str], str]], example_inputs: tuple, shapes: dict[str, list[int]],
         types: dict[str, Any]) -> Any:
    """One model of every region (input value names, output value name) of ``proto``, each with
    its own inputs (static, shaped like ``example_inputs`` in order) and its output; the shape of
    a model input it does not read (an upsample to another input's size) a constant, as ``shapes``
    has it, and its output of the type ``types`` names. None where a region reaches another value it does not read, or the model keeps its
    data elsewhere."""
    import onnx
    from onnx import helper

    graph = proto.graph
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer) \
            or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node
                   for a in n.attribute):
        return None
    all_nodes = list(graph.node)
    producer = {out: i for i, node in enumerate(all_nodes) for out in node.output}
    initializers = {t.name: t for t in graph.initializer}
    nodes, inputs, outputs, used = [], [], [], {}
    examples = iter(example_inputs)
    for i, (reads, end) in enumerate(regions):
        members = _members(end, set(reads), producer, all_nodes, initializers, shapes)
        if members is None or end not in types:
            return None
        for name in reads:
            value = next(examples)
            inputs.append(helper.make_tensor_value_info(f"r{i}_{name}", _element_type(value), list(value.shape)))

        def renamed(name: str, i: int = i) -> str:
            return name if not name or name in initializers else f"r{i}_{name}"

        for node in (all_nodes[index] for index in sorted(members)):
            copy = onnx.NodeProto()
            if _reads_shape_of(node, reads, shapes):
                copy.CopyFrom(_constant_shape(node, shapes[node.input[0]]))
            else:
                copy.CopyFrom(node)
            copy.name = f"r{i}_{node.name}" if node.name else ""
            copy.input[:] = [renamed(name) for name in copy.input]
            copy.output[:] = [renamed(name) for name in copy.output]
            nodes.append(copy)
            used.update((name, initializers[name]) for name in node.input if name in initializers)
        output = onnx.ValueInfoProto(name=f"r{i}_{end}")
        output.type.CopyFrom(types[end])  # its shape as the partition's model has it (symbolic sizes too)
        outputs.append(output)
    check = helper.make_graph(nodes, "region_check", inputs, outputs, initializer=list(used.values()))
    return helper.make_model(check, opset_imports=list(proto.opset_import), ir_version=proto.ir_version,
                             functions=list(proto.functions), producer_name=proto.producer_name)


def _members(end: str, reads: set[str], producer: dict[str, int], nodes: list, initializers: dict[str, Any],
             shapes: dict[str, list[int]]) -> set[int] | None:
    """The indices of the ``nodes`` computing ``end`` from the values ``reads``, constants and the
    shapes of model inputs; None if it needs any other value."""
    members: set[int] = set()
    stack = [end]
    while stack:
        name = stack.pop()
        if not name or name in reads or name in initializers:
            continue
        index = producer.get(name)
        if index is None:  # a graph input the region does not read
            return None
        if index not in members:
            members.add(index)
            if not _reads_shape_of(nodes[index], reads, shapes):
                stack.extend(nodes[index].input)
    return members


def _reads_shape_of(node: Any, reads: set[str], shapes: dict[str, list[int]]) -> bool:
    """Whether ``node`` reads only the shape of a model input of known sizes the region does not read."""
    return node.op_type == "Shape" and node.input[0] in shapes and node.input[0] not in reads


def _constant_shape(node: Any, sizes: list[int]) -> Any:
    """A Constant in place of the Shape ``node`` of an input of ``sizes``."""
    from onnx import TensorProto, helper

    attributes = {a.name: a.i for a in node.attribute}
    dims = sizes[attributes.get("start", 0):attributes.get("end", len(sizes))]
    value = helper.make_tensor(f"{node.output[0]}_value", TensorProto.INT64, [len(dims)], dims)
    return helper.make_node("Constant", [], [node.output[0]], name=node.name, value=value)


def _element_type(value: torch.Tensor) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(torch.empty((), dtype=value.dtype).numpy().dtype)


__all__ = ["cut", "remember"]
