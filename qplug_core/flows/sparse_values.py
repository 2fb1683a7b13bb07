"""Ops that take or make a sparse tensor (a GNN's ``torch.sparse.mm(adj, x)``) stay out of compiled
partitions.

A compiled partition is exported (ONNX, an SDK's graph) and its exporters take strided tensors only:
a ``sparse.mm`` inside one failed the export of the whole partition ("UnsupportedOperatorException:
aten._sparse_addmm"), so ONNX Runtime and OpenVINO kept every layer around it in reference form. So
these ops run in PyTorch, in float, and the partitions are planned around them: the layers on either
side still compile. The layouts are those of the example inputs (:data:`~qplug_core.flows.tags.LAYOUT`).
"""

from __future__ import annotations

from torch import fx

from qplug_core.flows.tags import LAYOUT
from qplug_core.partition.support import CALLABLE_OPS


def sparse_value_ops(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """The call nodes taking or making a tensor of a non-strided layout, with why they run in PyTorch."""
    ops: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        value = next((n for n in (node, *node.all_input_nodes) if LAYOUT in n.meta), None)
        if node.op not in CALLABLE_OPS or value is None:
            continue
        layout = value.meta[LAYOUT].removeprefix("torch.")
        what = f"makes a {layout} tensor" if value is node else f"takes {value.name!r}, a {layout} tensor"
        ops[node] = (f"it {what}: compiled partitions take strided tensors only (their exporters cannot "
                     "take it), so this op runs in float in PyTorch")
    return ops


__all__ = ["sparse_value_ops"]
