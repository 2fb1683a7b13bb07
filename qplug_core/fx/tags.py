"""Plain-data annotations that prepare leaves on nodes for convert and lowering.

Only plain values live in ``node.meta`` (no references to other nodes), so the tags survive
``copy.deepcopy`` of a GraphModule and every pass that copies meta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

#: node.meta key: what the node's value is ("float_tensor", "tensor" or "other")
VALUE_KIND = "qplug_value"
#: node.meta key: the :class:`RegionTag` of the region the node belongs to
REGION = "qplug_region"
#: node.meta key on observer nodes: which value they observe and why ("input"/"output"/"shared")
OBSERVER = "qplug_observer"
#: node.meta key on quantize/dequantize boundary nodes
BOUNDARY = "qplug_boundary"
#: node.meta key on nodes that run a backend kernel: the kernel's op name
KERNEL = "qplug_kernel"
#: node.meta key on the root node of a region (the node whose module carries the weight)
ROOT = "qplug_root"
#: node.meta key: which plugin pass wrote which annotation (see ``fx.annotation_guard``)
ANNOTATION_OWNERS = "qplug_annotation_owners"

# Keys of ``GraphModule.meta`` (and one module attribute) that carry state between the flows.

#: GraphModule.meta key: the backend and mode a model was prepared for
STATE = "qplug_state"
#: GraphModule.meta key: the fusions fuse_fx applied (list of FusionRecord)
FUSIONS = "qplug_fusions"
#: GraphModule.meta key: the QuantizationReport a convert step attached
REPORT = "qplug_report"
#: GraphModule.meta key: what ``qp.save`` writes (the reference form recorded at convert)
ARTIFACT = "qplug_artifact"
#: attribute of an eager-mode model prepared by ``qp.eager.prepare``
EAGER_STATE = "qplug_eager_state"
#: GraphModule.meta: the capture level used ("symbolic" or "export")
CAPTURE = "qplug_capture"
#: GraphModule.meta: submodules left opaque because capture failed, (name, type, reason)
CAPTURE_SKIPPED = "qplug_capture_skipped"
#: GraphModule.meta: the error a calibration raised (converting after it is refused)
CALIBRATION_FAILED = "qplug_calibration_failed"
#: GraphModule.meta: the example inputs prepare ran, replayed by the kernel contract at convert
EXAMPLE_INPUTS = "qplug_example_inputs"


@dataclass(frozen=True)
class RegionTag:
    """What prepare decided for the region a node belongs to."""

    region_id: int
    is_anchor: bool
    pattern: Any
    pattern_name: str
    quantized: bool
    reason: str
    weighted: bool
    is_dynamic: bool
    qconfig: Any = None
    dtype_config: Any = None


def value_kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "float_tensor" if value.is_floating_point() else "tensor"
    return "other"


class ValueAnnotator(fx.Interpreter):
    """Runs the graph once on example inputs and records each node's value kind.

    Knowing which values are float tensors lets prepare observe exactly those (never integer
    indices, shapes or tuples), instead of guessing from op names.
    """

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        n.meta[VALUE_KIND] = value_kind(result)
        return result


def region_tag(node: fx.Node) -> RegionTag | None:
    return node.meta.get(REGION)
