"""How much of a model's work each op of its reference form holds: weight elements and, where the
graph records shapes (torch.export's ``val``), multiply-adds (MACs). The report's int8 share is
weighed by these, not by a count of ops: a forecaster's one float LSTM beside its one int8 head
holds 98% of the weights, which "50% int8" hid.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx, nn

from qplug_core.flows.op_kinds import base_name
from qplug_core.flows.report import report_names
from qplug_core.flows.tags import region_tag
from qplug_core.kernels.reference import ReferenceRecurrent, ReferenceWeighted
from qplug_core.nn.intrinsic import FusedModule

#: ops whose MACs follow from their weight and output shapes (output elements x weight per output)
_WEIGHTED = {"linear", "conv1d", "conv2d", "conv3d", "convolution", "addmm"}
#: matmuls between activations: output elements x the contracted size
_MATMULS = {"matmul", "mm", "bmm"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu"}
_RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)


def work_by_name(gm: fx.GraphModule) -> dict[str, list[int | None]]:
    """Report name -> ``[weight elements, MACs or None when shapes are unknown]`` of every op of
    ``gm`` holding work; an int8 region's under its anchor's name (the sum over its ops)."""
    name = report_names(gm.graph)
    anchors = {tag.region_id: name(node) for node in gm.graph.nodes
               if (tag := region_tag(node)) is not None and tag.is_anchor}
    work: dict[str, list[int | None]] = {}
    for node in gm.graph.nodes:
        weights, macs = _node_work(gm, node)
        if weights == 0 and macs == 0:
            continue
        tag = region_tag(node)
        key = anchors.get(tag.region_id, name(node)) if tag is not None else name(node)
        total = work.setdefault(key, [0, 0])
        total[0] = int(total[0] or 0) + weights
        total[1] = None if total[1] is None or macs is None else total[1] + macs
    return work


def _node_work(gm: fx.GraphModule, node: fx.Node) -> tuple[int, int | None]:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, (ReferenceWeighted, ReferenceRecurrent)):
            module = module.module
        weights = sum(p.numel() for p in module.parameters())
        if isinstance(module, FusedModule):  # ConvBnReLU2d, LinearReLU, ...: its [0] does the MACs
            module = module[0]
        if isinstance(module, _RECURRENT):
            return weights, _recurrent_macs(module, node)
        if isinstance(module, nn.modules.conv._ConvTransposeNd):  # each input element meets the kernel
            return weights, _weighted_macs(node.args[0], module.weight)
        if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            return weights, _weighted_macs(node, module.weight)
        return weights, 0
    if node.op not in ("call_function", "call_method"):
        return 0, 0
    op = base_name(str(getattr(node.target, "__name__", node.target)))
    constants = [t for arg in node.args if (t := _constant(gm, arg)) is not None]
    weights = sum(t.numel() for t in constants)
    if op in _WEIGHTED and constants:
        weight = max(constants, key=lambda t: t.dim())
        return weights, _weighted_macs(node, weight)
    if op in _MATMULS or op in _ATTENTION:
        return weights, _matmul_macs(node, op)
    return weights, 0


def _constant(gm: fx.GraphModule, arg: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` feeds ``arg`` (through a dequantize or transpose or two), if any."""
    for _ in range(3):
        if not isinstance(arg, fx.Node):
            return None
        if arg.op == "get_attr":
            value = getattr(gm, str(arg.target), None)
            return value if isinstance(value, torch.Tensor) else None
        if arg.op != "call_function" or not arg.args:
            return None
        arg = arg.args[0]
    return None


def _shape(node: Any) -> tuple[int, ...] | None:
    return _dims(node.meta.get("val")) if isinstance(node, fx.Node) else None


def _dims(value: Any) -> tuple[int, ...] | None:
    """A recorded value's shape, a symbolic size as the example's (its hint); None if unknown."""
    sizes = []
    for size in getattr(value, "shape", None) or ():
        size = getattr(size.node, "hint", None) if isinstance(size, torch.SymInt) else size
        if not isinstance(size, int):
            return None
        sizes.append(size)
    return tuple(sizes) if isinstance(value, torch.Tensor) else None


def _weighted_macs(node: Any, weight: torch.Tensor | None) -> int | None:
    """Elements of ``node``'s value times the weight elements per output channel."""
    out = _shape(node)
    if out is None or weight is None or weight.dim() < 2:
        return None
    return math.prod(out) * (weight.numel() // weight.shape[0])


def _matmul_macs(node: fx.Node, op: str) -> int | None:
    """Output elements times the contracted size (read off either operand); attention's two."""
    shapes = [_shape(arg) for arg in node.args[:3]]
    if op in _ATTENTION:
        if len(shapes) < 3 or None in shapes:
            return None
        query, key, value = shapes
        return math.prod(query[:-1]) * key[-2] * (query[-1] + value[-1])  # type: ignore[index]
    out = _shape(node)
    left, right = (shapes + [None, None])[:2]
    inner = left[-1] if left else right[-2] if right and len(right) >= 2 else None
    return None if out is None or inner is None else math.prod(out) * inner


def _recurrent_macs(module: nn.Module, node: fx.Node) -> int | None:
    """Every step multiplies its input and hidden state by the layer's matrices."""
    value = node.meta.get("val")
    out = _dims(value[0] if isinstance(value, (tuple, list)) else value)
    if not out:
        return None
    directions = 2 if module.bidirectional else 1
    steps = math.prod(out) // (module.hidden_size * directions)
    return steps * sum(p.numel() for n, p in module.named_parameters() if n.startswith("weight"))
