"""qplug's quantize/dequantize ops rewritten as torch's ``quantized_decomposed`` ones.

That namespace is the convention PT2E's ``convert_pt2e`` writes and consumers match on (Inductor's
x86 int8 lowering, ExecuTorch's XNNPACK delegate): per-tensor qparams as Python numbers in the
call (``.default``), per-channel ones as tensors. torch defines it only in
``torch.ao.quantization.fx._decomposed``, which qplug does not import (``ir/qdq_ops.py``): it must be
registered already, as it is wherever those consumers are loaded.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from qplug_core.errors import ExportError

_QPLUG = torch.ops.qplug
#: qplug's op -> (the quantized_decomposed overload with Python-number qparams, or None for
#: per-channel ops, whose tensors stay; the overload taking tensor qparams)
_OVERLOADS = {
    _QPLUG.quantize_per_tensor.default: ("quantize_per_tensor", "default", "tensor"),
    _QPLUG.dequantize_per_tensor.default: ("dequantize_per_tensor", "default", "tensor"),
    _QPLUG.quantize_per_channel.default: ("quantize_per_channel", None, "default"),
    _QPLUG.dequantize_per_channel.default: ("dequantize_per_channel", None, "default"),
}

MISSING = ("torch defines the quantized_decomposed ops only in the deprecated "
           "torch.ao.quantization.fx._decomposed, which qplug does not import; Inductor's int8 "
           "lowering, ExecuTorch and torchao's PT2E load it themselves. Run `import "
           "torch.ao.quantization.fx._decomposed` before this call (and before torch.export.load of "
           "the program), or pass ops='qplug' for qplug's own ops with the same schemas")


def require_namespace() -> None:
    """Raise :class:`ExportError` unless torch's ``quantized_decomposed`` ops are registered."""
    try:
        torch.ops.quantized_decomposed.quantize_per_tensor.default  # noqa: B018 (a lookup)
    except (AttributeError, RuntimeError) as exc:
        raise ExportError("ops='quantized_decomposed' needs that op namespace: " + MISSING) from exc


def _constant(gm: fx.GraphModule, node: object) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads, or None for any other argument."""
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    value = gm
    for atom in str(node.target).split("."):
        value = getattr(value, atom)
    return value if isinstance(value, torch.Tensor) and value.numel() == 1 else None


def _dynamic(gm: fx.GraphModule, node: fx.Node) -> None:
    """``dynamic_fake_quantize(x, qmin, qmax, dtype)`` as PT2E writes dynamic quantization:
    ``choose_qparams.tensor`` (min/max with 0, float32 eps, as qplug's) then quantize and dequantize
    with those tensor qparams."""
    namespace = torch.ops.quantized_decomposed
    x, quant_min, quant_max, dtype = node.args
    with gm.graph.inserting_before(node):
        chosen = gm.graph.call_function(namespace.choose_qparams.tensor,
                                        (x, quant_min, quant_max, torch.finfo(torch.float32).eps, dtype))
        scale = gm.graph.call_function(operator.getitem, (chosen, 0))
        zero_point = gm.graph.call_function(operator.getitem, (chosen, 1))
        q = gm.graph.call_function(namespace.quantize_per_tensor.tensor,
                                   (x, scale, zero_point, quant_min, quant_max, dtype))
        dq = gm.graph.call_function(namespace.dequantize_per_tensor.tensor,
                                    (q, scale, zero_point, quant_min, quant_max, dtype))
    node.replace_all_uses_with(dq)
    gm.graph.erase_node(node)


def to_decomposed(gm: fx.GraphModule) -> None:
    """Rewrite ``gm`` (an ``ExportedProgram.module()``) in place: each qplug quantize/dequantize
    becomes its ``quantized_decomposed`` twin, per-tensor qparams read from constants into the
    call, dynamic quantization becomes ``choose_qparams`` + quantize/dequantize, and the
    attributes no node reads any more are dropped."""
    namespace = torch.ops.quantized_decomposed
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == _QPLUG.dynamic_fake_quantize.default:
            _dynamic(gm, node)
            continue
        names = _OVERLOADS.get(node.target) if node.op == "call_function" else None
        if names is None:
            continue
        packet, scalars, tensors = (getattr(namespace, names[0]), names[1], names[2])
        scale, zero_point = _constant(gm, node.args[1]), _constant(gm, node.args[2])
        if scalars is not None and scale is not None and zero_point is not None:
            node.args = (node.args[0], float(scale), int(zero_point), *node.args[3:])
            node.target = getattr(packet, scalars)
        else:
            node.target = getattr(packet, tensors)
    gm.graph.eliminate_dead_code()
    read = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    for name, _ in [*gm.named_buffers(), *gm.named_parameters()]:
        if name not in read:
            owner, _, leaf = name.rpartition(".")
            delattr(gm.get_submodule(owner), leaf)
    gm.recompile()

