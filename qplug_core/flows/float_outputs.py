"""Float outputs for a backend that fuses a weighted op's dequantization into it.

On such a backend (``BackendSpec.float_outputs``: OpenVINO's FullyConnected and Convolution take u8
and write f32; ONNX Runtime's MatMulIntegerToFloat, linears only) the output of a static weighted
op of those kinds that no static int8 op reads needs no grid: prepare leaves it unobserved
(``regions._keep_unread_outputs_float``). A reference form made for
another backend (``backend="auto"`` calibrates once, on a backend without float outputs) still
holds those grids; :func:`drop_unread_output_grids` removes them when it is finished on this one,
giving the model this backend's own prepare would.
"""

from __future__ import annotations

from torch import fx

from qplug_core.flows.regions import weighted_kind
from qplug_core.flows.tags import region_tag
from qplug_core.kernels.reference import Dequantize, Quantize, ReferenceWeighted


def _module(gm: fx.GraphModule, node: fx.Node, kind: type) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), kind)


def _read_by_static_int8(node: fx.Node) -> bool:
    tag = region_tag(node)
    return tag is not None and tag.quantized and not tag.is_dynamic


def drop_unread_output_grids(gm: fx.GraphModule, kinds: frozenset[str]) -> int:
    """Remove the Quantize -> Dequantize pair after each static weighted op of one of ``kinds``
    (int8 input) whose dequantized output no static int8 op reads; returns how many (the graph
    is recompiled)."""
    pairs = [pair for node in gm.graph.nodes if (pair := _unread_output_grid(gm, node, kinds)) is not None]
    for node, quantize, dequantize in pairs:
        dequantize.replace_all_uses_with(node)
        for pair_node in (dequantize, quantize):
            gm.graph.erase_node(pair_node)
            if not any(n.op == "call_module" and n.target == pair_node.target for n in gm.graph.nodes):
                gm.delete_submodule(str(pair_node.target))
    if pairs:
        gm.graph.lint()
        gm.recompile()
    return len(pairs)


def _unread_output_grid(gm: fx.GraphModule, node: fx.Node, kinds: frozenset[str]
                        ) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(op, quantize, dequantize) where ``node`` is a static weighted op of one of ``kinds`` whose
    output grid no static int8 op reads, else None."""
    if not (_module(gm, node, ReferenceWeighted) and weighted_kind(gm.get_submodule(str(node.target))) in kinds
            and node.args and isinstance(node.args[0], fx.Node)
            and _module(gm, node.args[0], Dequantize) and len(node.users) == 1):
        return None
    (quantize,) = node.users
    if not (_module(gm, quantize, Quantize) and len(quantize.users) == 1):
        return None
    (dequantize,) = quantize.users
    if not _module(gm, dequantize, Dequantize) or any(_read_by_static_int8(u) for u in dequantize.users):
        return None
    return node, quantize, dequantize
