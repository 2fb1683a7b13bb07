"""What a quantization did: fusions, int8 regions, kernels, and every op left in float with why;
and that as text a user reads top-down (the int8 share first, then what stayed float).

Every line of the text fits :data:`WIDTH` columns (names too long for a line are wrapped, never
allowed to push a line wider). Float ops are grouped by reason, compute ops only; shape and
integer plumbing is one line with the most frequent op names, unless ``verbose`` lists every node.
"""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from torch import fx

from qplug_core.flows.fuse import FusionRecord
from qplug_core.flows.op_kinds import COMPUTE, base_name, op_kind
from qplug_core.flows.raise_aten import pattern_level_name
from qplug_core.flows.tags import BOUNDARY, KERNEL, OBSERVER, VALUE_KIND, region_tag
from qplug_core.kernels.reference import ReferenceRecurrent, ReferenceWeighted
from qplug_core.patterns import is_match_all

if TYPE_CHECKING:
    from rich.text import Text

    from qplug_core.config import BackendConfig

_NON_COMPUTE_FUNCTIONS = {"getattr", "getitem", "size", "dim"}
#: why an op stays float when no pattern matches it
NO_PATTERN = "no quantization pattern of the backend matches this op"
#: ... when it is an ATen op that capture left as torch.export wrote it while the backend's patterns
#: name its module or functional form: saying only that none matches read as if the backend had no
#: pattern for ``F.interpolate`` when its ATen form simply had no mapping (an ATen op no pattern
#: names, ``gelu`` on fbgemm, gets :data:`NO_PATTERN`, as at the symbolic level)
UNMAPPED_ATEN = ("no quantization pattern of the backend matches this op: it is an ATen op from "
                 "torch.export that qplug does not map to the module or functional the patterns name")
#: the ``capture`` of a report read from a module-swap model's record (no graph was captured)
MODULE_SWAP = "module swap"


@dataclass
class SkippedNode:
    node: str
    op: str
    reason: str
    #: "compute" (could have been int8), "shape" or "integer" (plumbing): see qplug_core.flows.op_kinds
    kind: str = COMPUTE
    #: the compiled partition of a delegating backend it runs in, in float ('': in PyTorch)
    partition: str = ""


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
    #: regions a delegating backend's check kept out of its partitions: end node -> why
    kept_regions: dict[str, str] = field(default_factory=dict)
    #: backend="auto": every backend tried (backend, status, reason, median_ms, sqnr_db)
    auto: list[dict[str, Any]] = field(default_factory=list)
    #: a module-swap model's record beyond its layers (scheme, algorithm, smoothing, fusion)
    record: dict[str, Any] = field(default_factory=dict)
    #: what the conversion could not check or decide, and why (e.g. the kernel contract not run)
    notes: list[str] = field(default_factory=list)
    #: ``qp.quantize``: the accuracy recipe and target applied, and why ('' for other flows)
    recipe: str = ""
    #: int8 layers whose output stays float: the backend dequantizes into it (``float_outputs``)
    float_outputs: list[str] = field(default_factory=list)
    #: op or region (report name) -> [weight elements, MACs or None]: what the int8 share weighs
    #: (``flows/work_share.py``; empty for a module-swap model)
    work: dict[str, list[int | None]] = field(default_factory=dict)
    #: ``qp.quantize``, ``qp.convert_fx``: the model returned and its reference form against the
    #: float model on a calibration batch (output: the name of the worst float output, which the
    #: scores are of; cosine, sqnr_db, reference_cosine, reference_sqnr_db: None where the final
    #: model is above 20 dB and its reference form was not run; derived, derived_cosine: where an
    #: accuracy target scored a derived output, such as a sentence encoder's pooled embedding, its
    #: name and its mean cosine over the batch; flows/final_check.py)
    final_check: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __rich__(self):
        return report_text(self)

    def __str__(self) -> str:
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
        module = gm.get_submodule(node.target)
        if isinstance(module, (ReferenceWeighted, ReferenceRecurrent)):  # the layer the user wrote,
            module = module.module  # not its int8 wrapper
        return type(module).__name__
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def op_key(name: str) -> str:
    """One spelling of an op's name at both capture levels: ``GroupNorm``, ``group_norm`` and
    ``group_norm.default`` -> ``groupnorm``; ``InstanceNorm2d`` -> ``instancenorm``."""
    key = "".join(c for c in base_name(name).lower() if c.isalnum())
    return re.sub(r"(?<=[a-z])[123n]d$", "", key)


def pattern_op_keys(config: BackendConfig) -> frozenset[str]:
    """The :func:`op_key` of every op ``config``'s patterns name (anchors and fused members)."""
    keys: set[str] = set()

    def visit(element: Any) -> None:
        if isinstance(element, tuple):
            for item in element:
                visit(item)
        elif not is_match_all(element):
            keys.add(op_key(element if isinstance(element, str) else getattr(element, "__name__", "")))

    for pattern_config in config.configs:
        visit(pattern_config.pattern_complex_format)
    return frozenset(keys - {""})


def no_pattern_reason(node: fx.Node, pattern_ops: frozenset[str] = frozenset()) -> str:
    """Why ``node``, which no pattern matched, stays float; ``pattern_ops`` (see
    :func:`pattern_op_keys`) tells an ATen op capture did not raise to a form the backend's
    patterns name from one they do not name at all."""
    if node.op != "call_function" or not str(node.target).startswith("aten."):
        return NO_PATTERN
    name = pattern_level_name(base_name(getattr(node.target, "__name__", "")))
    return UNMAPPED_ATEN if op_key(name) in pattern_ops else NO_PATTERN


def float_compute_nodes(gm: fx.GraphModule, fallback_reasons: dict[str, str] | None = None,
                        opaque_modules: dict[str, str] | None = None,
                        partitions: dict[str, fx.GraphModule] | None = None,
                        compiled: frozenset[str] = frozenset(),
                        pattern_ops: frozenset[str] = frozenset()) -> list[SkippedNode]:
    """Every op that still computes in float, with the reason recorded by prepare or lowering
    (an op no pattern matched: :func:`no_pattern_reason` with ``pattern_ops``).

    ``fallback_reasons`` (anchor name as :func:`report_names` gives it -> reason) marks int8
    regions that lowering or delegation left in reference form: they compute in float between
    dequantize and quantize, so they are listed too. ``opaque_modules`` (module path -> reason)
    are submodules capture could not look into. ``partitions`` (submodule -> its reference form)
    are a delegating backend's partitions: the float ops inside them are listed as if they were
    not fused (a float linear compiled into an ONNX Runtime session is still a float linear),
    never the partition call itself; those of the ``compiled`` ones name their partition.
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
        if node.op == "call_module" and partitions and node.target in partitions:
            inside = float_compute_nodes(partitions[node.target], fallback_reasons, opaque,
                                         pattern_ops=pattern_ops)
            where = str(node.target) if node.target in compiled else ""
            skipped += [replace(entry, partition=where) for entry in inside]
            continue
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
            reason = no_pattern_reason(node, pattern_ops)
        elif not tag.quantized:
            reason = tag.reason
        elif fallback_reasons and anchors.get(tag.region_id) in fallback_reasons:
            reason = fallback_reasons[anchors[tag.region_id]]
        else:
            continue
        skipped.append(SkippedNode(node.target if node.target in opaque else report_key(node), op,
                                   reason, op_kind(node.meta.get(VALUE_KIND), op, _has_float_weights(gm, node))))
    return skipped


def _has_float_weights(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A module call holding float parameters (an LSTM returning a tuple computes all the same)."""
    if node.op != "call_module":
        return False
    try:
        module = gm.get_submodule(node.target)
    except AttributeError:
        return False
    return any(p.is_floating_point() for p in module.parameters())


def top_reasons(report: QuantizationReport, n: int = 3) -> list[tuple[str, int]]:
    """The ``n`` most frequent reasons compute ops stayed float (shape and integer plumbing only
    when nothing else is left), with how many ops each covers."""
    counts: dict[str, int] = {}
    compute = [entry for entry in report.skipped if entry.kind == COMPUTE]
    for entry in compute or report.skipped:
        counts[entry.reason] = counts.get(entry.reason, 0) + 1
    return sorted(counts.items(), key=lambda item: -item[1])[:n]


# -- the report as text (see the module docstring) ---------------------------------------------

#: the width every line of the summary fits in
WIDTH = 80
#: op names shown in a one-line count ("layer_norm 5, add 4, ... +3 more")
TOP_OPS = 5


def _wrap(text: str, width: int, indent: str = "", hang: str = "") -> list[str]:
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=hang or indent,
                         break_long_words=True, break_on_hyphens=False) or [indent.rstrip()]


def op_counts(entries: list[SkippedNode], top: int = TOP_OPS) -> str:
    """``"layer_norm 5, add 4, softmax 2 (+3 more)"``: the most frequent op names first."""
    counts = Counter(base_name(entry.op) for entry in entries).most_common()
    listed = ", ".join(f"{op} {n}" for op, n in counts[:top])
    return listed + (f" (+{len(counts) - top} more)" if len(counts) > top else "")


def by_reason(entries: list[SkippedNode]) -> list[tuple[str, list[SkippedNode]]]:
    """``entries`` grouped by reason, the largest group first (ties in first-seen order)."""
    groups: dict[str, list[SkippedNode]] = {}
    for entry in entries:
        groups.setdefault(entry.reason, []).append(entry)
    return sorted(groups.items(), key=lambda item: -len(item[1]))


def split_plumbing(report: QuantizationReport) -> tuple[list[SkippedNode], list[SkippedNode]]:
    """(compute ops left in float, shape and integer ops) of ``report.skipped``."""
    compute = [s for s in report.skipped if getattr(s, "kind", COMPUTE) == COMPUTE]
    return compute, [s for s in report.skipped if getattr(s, "kind", COMPUTE) != COMPUTE]


def int8_share_line(report: QuantizationReport) -> str:
    """``int8: 97% of MACs, 96% of weights (2 compute op(s) left in float)``, the answer in one
    line, weighed by the work each op holds (MACs only where every op's shapes are known): a
    count of ops read "50% int8" for a forecaster whose float LSTM held 98% of the weights. A
    module-swap model: ``quantized: 14 layer(s), 1 layer(s) left in float (93% quantized)``."""
    compute, _ = split_plumbing(report)
    regions = len(report.quantized)
    if report.capture == MODULE_SWAP:
        total = regions + len(compute)
        share = f" ({regions / total:.0%} quantized)" if total else ""
        return f"quantized: {regions} layer(s), {len(compute)} layer(s) left in float{share}"
    shares = _work_shares(report, compute)
    if not shares:
        total = regions + len(compute)
        share = f" ({regions / total:.0%} int8)" if total else ""
        return f"int8: {regions} region(s), {len(compute)} compute op(s) left in float{share}"
    return f"int8: {', '.join(shares)} ({len(compute)} compute op(s) left in float)"


def _work_shares(report: QuantizationReport, compute: list[SkippedNode]) -> list[str]:
    """``["97% of MACs", "96% of weights"]``: the int8 regions' share of the work of the regions
    and float compute ops (a region left in reference form counts as float). Where some op's
    shapes are unknown and some ops are float, the MACs share says so rather than vanish: ">99% of
    weights" alone read as all int8 for a conformer whose attention matmuls stayed float."""
    int8 = [report.work[name] for name in report.quantized if name in report.work and name not in report.reference]
    floats = [report.work[name] for name in {e.node for e in compute} | set(report.reference) if name in report.work]
    shares, unknown = [], ""
    for index, unit in ((1, "MACs"), (0, "weights")):
        missing = sum(work[index] is None for work in int8 + floats)
        if missing:  # with nothing float, all of it is int8 anyway
            unknown = f"{unit} unknown for {missing} op(s) without shapes" if floats else ""
            continue
        done, left = sum(w[index] or 0 for w in int8), sum(w[index] or 0 for w in floats)
        if done + left:
            shares.append(f"{_percent(done, done + left)} of {unit}")
    return shares + [unknown] if shares and unknown else shares


def _percent(part: int, whole: int) -> str:
    """``part / whole`` as a whole percentage that never rounds a float op away (or an int8 one)."""
    share = part / whole
    if 0.995 <= share < 1:
        return ">99%"
    return "<1%" if 0 < share < 0.005 else f"{share:.0%}"


def fact_lines(facts: dict[str, Any], width: int, indent: str = "") -> list[str]:
    """``key: value`` lines (nested dicts as ``k v, k v``), wrapped to ``width``."""
    lines = []
    for key, value in facts.items():
        text = (", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict)
                else str(value))
        lines += textwrap.wrap(f"{key.replace('_', ' ')}: {text}", width, initial_indent=indent,
                               subsequent_indent=indent + "    ", break_on_hyphens=False)
    return lines


def _kernel_lines(report: QuantizationReport, width: int) -> list[str]:
    lines = []
    if report.kernels:
        kernels = Counter(report.kernels.values()).most_common()
        lines += _wrap(f"on backend kernels: {len(report.kernels)} ("
                       + ", ".join(f"{k} {n}" for k, n in kernels) + ")", width, "  ", "    ")
    if report.reference:
        reasons = Counter(report.reference.values()).most_common()
        lines += _wrap(f"reference form (no kernel): {len(report.reference)}", width, "  ")
        for reason, n in reasons[:3]:
            lines += _wrap(f"{n:>3}  {reason}", width, "    ", "         ")
    if report.fusions:
        kinds = Counter(f.fused_type for f in report.fusions).most_common()
        lines += _wrap(f"fusions: {len(report.fusions)} ("
                       + ", ".join(f"{k} {n}" for k, n in kinds) + ")", width, "  ", "    ")
    if report.float_outputs:
        names = ", ".join(report.float_outputs[:5]) + (" and more" if len(report.float_outputs) > 5 else "")
        lines += _wrap(f"float outputs: {len(report.float_outputs)} int8 layer(s) write float, not "
                       f"an 8-bit grid (the backend dequantizes into them; backend='reference' and "
                       f"backends without float outputs round them, so outputs differ by that "
                       f"rounding): {names}", width, "  ", "    ")
    if report.partitions:
        modules = Counter(p["module"] for p in report.partitions).most_common()
        lines += _wrap(f"compiled partitions: {len(report.partitions)} ("
                       + ", ".join(f"{m} {n}" for m, n in modules) + f"), {len(report.outside)} "
                       "node(s) left in PyTorch", width, "  ", "    ")
        lines += _reference_input_lines(report, width)
    return lines


def _reference_input_lines(report: QuantizationReport, width: int) -> list[str]:
    """``delegate_0: reference form for (32, 1, 8, 8) float32: its compiled model raised ...``: the
    input signatures a compiled partition answers in reference form (a benchmark at those sizes
    measures the reference form, though the partition reads "compiled")."""
    lines = []
    for record in report.partitions:
        by_reason: dict[str, list[str]] = {}
        for signature, reason in record.get("reference_inputs", {}).items():
            by_reason.setdefault(reason, []).append(signature)
        for reason, signatures in by_reason.items():
            lines += _wrap(f"{record['name']}: reference form for {'; '.join(signatures)}: {reason}",
                           width, "    ", "      ")
    return lines


def _float_lines(report: QuantizationReport, width: int, verbose: bool) -> list[str]:
    compute, plumbing = split_plumbing(report)
    lines = []
    if compute:
        inside = sum(1 for entry in compute if getattr(entry, "partition", ""))
        where = f" ({inside} inside compiled partitions)" if inside else ""
        lines.append(f"left in float: {len(compute)} compute op(s){where}, by reason")
        for reason, entries in by_reason(compute):
            lines += _wrap(f"{len(entries):>4}  {reason}", width, "", "      ")
            detail = (", ".join(f"{e.node} ({e.op})" for e in entries) if verbose
                      else op_counts(entries))
            lines += _wrap(detail, width, "      ")
    if plumbing:
        if verbose:
            lines.append(f"shape and integer ops: {len(plumbing)} (no int8 gain)")
            for reason, entries in by_reason(plumbing):
                lines += _wrap(f"{len(entries):>4}  {reason}", width, "", "      ")
                lines += _wrap(", ".join(f"{e.node} ({e.op})" for e in entries), width, "      ")
        else:
            lines += _wrap(f"+ {len(plumbing)} shape and integer op(s), no int8 gain: "
                           f"{op_counts(plumbing, 3)}; --verbose lists them", width, "", "  ")
    return lines


def report_lines(report: QuantizationReport, *, verbose: bool = False,
                 width: int = WIDTH) -> list[str]:
    """The report as lines of at most ``width`` columns, the int8 share first."""
    head = (f"qplug quantization report: {report.mode}, quantized by module swap ({report.backend})"
            if report.capture == MODULE_SWAP else
            f"qplug quantization report: backend {report.backend}, {report.mode}, {report.capture} capture")
    notes = [line for note in report.notes for line in _wrap(f"note: {note}", width, "  ", "    ")]
    return [*_wrap(head, width), *notes, *_auto_lines(report, width), *_wrap(int8_share_line(report), width),
            *(_wrap(f"recipe: {report.recipe}", width, "  ", "    ") if report.recipe else []),
            *_final_check_lines(report, width),
            *fact_lines(report.record, width, "  "), *_kernel_lines(report, width),
            *_float_lines(report, width, verbose)]


def _auto_lines(report: QuantizationReport, width: int) -> list[str]:
    """backend="auto": each backend tried, its median on the example inputs and why."""
    tried = [trial for trial in report.auto if trial["status"] != "baseline"]  # the float model's row
    lines = _wrap(f"backend='auto' tried {len(tried)} backend(s):", width) if report.auto else []
    for trial in report.auto:
        timing = f"{trial['median_ms']:.3g} ms" if trial.get("median_ms") is not None else "-"
        db = trial.get("sqnr_db")
        sqnr = "" if db is None else (", identical to the reference form" if db >= 200 else
                                      f", {db:.1f} dB vs the reference form")
        base = " (calibrated with its qparams)" if trial.get("base") else ""
        lines += _wrap(f"{trial['backend']}{base}: {trial['status']}, {timing}{sqnr}: "
                       f"{trial['reason']}", width, "  ", "    ")
    return lines


def _final_check_lines(report: QuantizationReport, width: int) -> list[str]:
    check = report.final_check
    if not check:
        return []
    reference = ("not run (the final model is above 20 dB)" if check.get("reference_sqnr_db") is None else
                 f"cosine {check['reference_cosine']:.4f}, SQNR {check['reference_sqnr_db']:.1f} dB")
    output = f" ({check['output']}, the worst output)" if check.get("output", "output") != "output" else ""
    lines = _wrap(f"final model vs float on a calibration batch{output}: cosine {check['cosine']:.4f}, SQNR "
                  f"{check['sqnr_db']:.1f} dB; reference form: {reference}", width, "  ", "    ")
    if check.get("derived"):
        lines += _wrap(f"{check['derived']} (what the accuracy target scores): cosine "
                       f"{check['derived_cosine']:.4f}, the mean over the batch", width, "    ", "      ")
    return lines


def report_text(report: QuantizationReport, *, verbose: bool = False, width: int = WIDTH) -> Text:
    """:func:`report_lines` as one rich Text (what ``rich.print(report)`` shows)."""
    from rich.text import Text

    return Text("\n".join(report_lines(report, verbose=verbose, width=width)))
