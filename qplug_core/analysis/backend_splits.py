"""Split a model into the parts a backend can run in int8 and the parts that stay float.

The decision is the flows' own (same matcher, qconfig resolution, dtype constraints, connector rule
and kernel table), so what this reports is what ``prepare_fx``/``convert_fx`` will do; the
partitioner then groups the int8 nodes into acyclic submodules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from qplug_core.flows.pipeline import as_input_tuple, fuse_model
from qplug_core.flows.report import no_pattern_reason, pattern_op_keys
from qplug_core.flows.tags import ValueAnnotator
from qplug_core.partition.partitioner import CapabilityBasedPartitioner, Partition
from qplug_core.partition.support import OperatorSupportBase

_COMPUTE_OPS = ("call_module", "call_function", "call_method")


@dataclass
class BackendSplit:
    """The int8 partitions and, for every other compute node, why it stays float."""

    graph_module: fx.GraphModule
    partitions: list[Partition]
    int8_nodes: list[str] = field(default_factory=list)
    float_nodes: dict[str, str] = field(default_factory=dict)


class _NodeSet(OperatorSupportBase):
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def is_node_supported(self, submodules: Any, node: fx.Node) -> bool:
        return node.name in self.names


def by_backend(model: nn.Module, backend: Any, example_inputs: Any, *, qconfig_mapping=None,
               fuse: bool = False) -> BackendSplit:
    """Decide, node by node, what ``backend`` runs in int8; optionally fuse the int8 partitions.

    ``model`` is captured and fused as ``prepare_fx`` would (the user's model is not modified).
    With ``fuse=True`` each int8 partition becomes a submodule called through ``call_module``.
    """
    from qplug_core.flows.regions import RegionPlanner
    from qplug_core.registry.backends import resolve_backend

    chosen = resolve_backend(backend)
    gm = fuse_model(model, chosen)
    ValueAnnotator(gm).run(*as_input_tuple(example_inputs))
    mapping = qconfig_mapping or chosen.default_qconfig_mapping("static")
    regions = RegionPlanner(gm, chosen, mapping, on_unsupported="skip").plan()
    int8, reasons = set(), {}
    for region in regions:
        has_kernel = region.match.pattern in chosen.kernels or not chosen.kernels
        for node in region.match.nodes:
            if region.quantized and has_kernel:
                int8.add(node.name)
            elif region.quantized:
                reasons[node.name] = f"backend {chosen.name!r} has no kernel for {region.pattern_name}"
            else:
                reasons[node.name] = region.reason
    pattern_ops = pattern_op_keys(chosen.config)
    float_nodes = {n.name: reasons[n.name] if n.name in reasons else no_pattern_reason(n, pattern_ops)
                   for n in gm.graph.nodes if n.op in _COMPUTE_OPS and n.name not in int8}
    order = [n.name for n in gm.graph.nodes if n.name in int8]
    partitioner = CapabilityBasedPartitioner(gm, _NodeSet(int8), allows_single_node_partition=True)
    partitions = partitioner.propose_partitions()
    if fuse:
        gm = partitioner.fuse_partitions(partitions, prefix="int8_")
    return BackendSplit(gm, partitions, order, float_nodes)
