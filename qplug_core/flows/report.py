"""What a quantization did: fusions, int8 regions, kernels, and every op left in float with why."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from torch import fx

from qplug_core.flows.fuse import FusionRecord
from qplug_core.flows.op_kinds import COMPUTE, op_kind
from qplug_core.flows.tags import BOUNDARY, KERNEL, OBSERVER, VALUE_KIND, region_tag

_NON_COMPUTE_FUNCTIONS = {"getattr", "getitem", "size", "dim"}


@dataclass
class SkippedNode:
    node: str
    op: str
    reason: str
    #: "compute" (could have been int8), "shape" or "integer" (plumbing): see qplug_core.flows.op_kinds
    kind: str = COMPUTE


@dataclass
class QuantizationReport:
    """The record of one quantization; ``skipped`` lists every float compute op with a reason."""

    backend: str
    mode: str
    fusions: list[FusionRecord] = field(default_factory=list)
    # keys: the anchor's name as report_names gives it (module name for a module called once)
    quantized: dict[str, str] = field(default_factory=dict)  # anchor -> pattern
    kernels: dict[str, str] = field(default_factory=dict)  # anchor -> kernel op
    reference: dict[str, str] = field(default_factory=dict)  # anchor -> why no kernel
    skipped: list[SkippedNode] = field(default_factory=list)
    capture: str = "symbolic"  # how the model was captured: "symbolic" or "export"
    #: compiled partitions of a delegating backend: name, nodes, int8_regions, module
    partitions: list[dict[str, Any]] = field(default_factory=list)
    #: nodes a delegating backend left in PyTorch -> why
    outside: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __rich__(self):
        from qplug_core.flows.report_text import report_text

        return report_text(self)

    def __str__(self) -> str:
        from qplug_core.flows.report_text import report_lines

        return "\n".join(report_lines(self))


def report_names(graph: fx.Graph) -> Callable[[fx.Node], str]:
    """How reports name the nodes of ``graph``: a module called once by the module's qualified
    name (what ``model.get_submodule`` takes: ``layer1.0.conv1``, ``2``), anything else (ops,
    a module called twice) by the node's unique name."""
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")

    def name(node: fx.Node) -> str:
        if node.op == "call_module" and calls[node.target] == 1:
            return str(node.target)
        return node.name

    return name


def describe_op(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def float_compute_nodes(gm: fx.GraphModule, fallback_reasons: dict[str, str] | None = None,
                        opaque_modules: dict[str, str] | None = None) -> list[SkippedNode]:
    """Every op that still computes in float, with the reason recorded by prepare or lowering.

    ``fallback_reasons`` (anchor node name -> reason) marks int8 regions that lowering left in
    reference form: they compute in float between dequantize and quantize, so they are listed too.
    ``opaque_modules`` (module path -> reason) are submodules capture could not look into.
    """
    report_key = report_names(gm.graph)
    opaque = opaque_modules or {}
    anchors = {}
    for node in gm.graph.nodes:
        tag = region_tag(node)
        if tag is not None and tag.is_anchor:
            anchors[tag.region_id] = report_key(node)
    skipped = []
    for node in gm.graph.nodes:
        if (node.op not in ("call_module", "call_function", "call_method")
                or OBSERVER in node.meta or BOUNDARY in node.meta or KERNEL in node.meta):
            continue
        op = describe_op(node, gm)
        if op in _NON_COMPUTE_FUNCTIONS:
            continue
        tag = region_tag(node)
        if node.op == "call_module" and node.target in opaque:
            reason = opaque[node.target]
        elif tag is None:
            reason = "no quantization pattern of the backend matches this op"
        elif not tag.quantized:
            reason = tag.reason
        elif fallback_reasons and anchors.get(tag.region_id) in fallback_reasons:
            reason = fallback_reasons[anchors[tag.region_id]]
        else:
            continue
        skipped.append(SkippedNode(node.target if node.target in opaque else report_key(node), op,
                                   reason, op_kind(node.meta.get(VALUE_KIND), op)))
    return skipped


def top_reasons(report: QuantizationReport, n: int = 3) -> list[tuple[str, int]]:
    """The ``n`` most frequent reasons compute ops stayed float (shape and integer plumbing only
    when nothing else is left), with how many ops each covers."""
    counts: dict[str, int] = {}
    compute = [entry for entry in report.skipped if entry.kind == COMPUTE]
    for entry in compute or report.skipped:
        counts[entry.reason] = counts.get(entry.reason, 0) + 1
    return sorted(counts.items(), key=lambda item: -item[1])[:n]
