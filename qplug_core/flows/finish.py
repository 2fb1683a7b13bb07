"""The last step of every conversion: lower the reference form to a backend and attach the report.

Shared by ``convert_fx`` and ``qp.load`` (which rebuilds the reference form from a file), so it
lives below both the flows and serialization, and above fx and delegation (a delegating backend
compiles its partitions here, before per-op lowering).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from torch import fx

from qplug_core.enums import Stage
from qplug_core.flows.delegate import DelegationSummary, StoredModels, delegate_graph
from qplug_core.flows.exported_inputs import guard_exported_inputs
from qplug_core.flows.float_outputs import drop_unread_output_grids
from qplug_core.flows.freed_memory import give_back_freed_memory
from qplug_core.flows.held_forms import hold_reference_forms_as_int8
from qplug_core.flows.input_dtypes import guard_input_dtypes
from qplug_core.flows.input_faults import explain_call_faults
from qplug_core.flows.lower import LoweringSummary, lower_graph
from qplug_core.flows.pickle_guard import refuse_torch_shipping
from qplug_core.flows.pipeline import plugin_passes, run_passes
from qplug_core.flows.region_parity import is_float_output
from qplug_core.flows.report import QuantizationReport, float_compute_nodes, pattern_op_keys, report_names
from qplug_core.flows.snapshot import hold_weight_as_int8
from qplug_core.flows.tags import (
    CAPTURE,
    CAPTURE_SKIPPED,
    CONVERSION_NOTES,
    EXAMPLE_INPUTS,
    FIXED_KEYWORDS,
    FUSIONS,
    PARTITION_FORMS,
    REPORT,
    recorded_example_inputs,
    region_tag,
)
from qplug_core.flows.work_share import work_by_name
from qplug_core.ir.autocast_off import compute_in_float32
from qplug_core.ir.call_inputs import guard_input_names
from qplug_core.kernels.base import pin_engine
from qplug_core.kernels.held_int8 import Copies

if TYPE_CHECKING:
    from qplug_core.registry.backends import Backend


def finish_conversion(gm: fx.GraphModule, backend: Backend, *, mode: str, lower: bool = True,
                      loading: bool = False, keep_reference: dict[str, str] | None = None,
                      keep_regions: dict[str, str] | None = None,
                      stored: StoredModels | None = None, progress: bool | None = False) -> QuantizationReport:
    """Lower a reference-form model to ``backend`` (post_convert passes too) and attach its report.

    Shared by convert_fx and qp.load, which rebuilds the reference form from a file: ``loading``
    runs nothing (delegated partitions compile at their first call, on the caller's inputs, never
    on shapes a file records) and ``keep_reference`` (int8 anchor -> why, as recorded at convert)
    keeps those regions in reference form, as ``keep_regions`` (end node -> why) keeps the regions
    a delegate's check kept out of its partitions then; ``stored`` (partition -> its ONNX models
    the file holds) is what delegated partitions build their first models from. ``progress``
    shows the delegated partitions compiled and checked (``flows/progress.py``).
    """
    if backend.float_outputs:  # a reference form made for another backend (auto) keeps them
        drop_unread_output_grids(gm, backend.float_outputs)
    regions = quantized_regions(gm)
    unrounded = float_outputs(gm)
    work = work_by_name(gm)  # of the reference form: lowering replaces the ops that hold it
    found: dict[str, LoweringSummary] = {}
    delegated = DelegationSummary()
    delegate = backend.delegate if lower else None

    def delegate_partitions(graph_module: fx.GraphModule) -> None:
        nonlocal delegated
        # the example inputs prepare ran (real values: zeros of their shape would check little)
        example = None if loading else (graph_module.meta.get(EXAMPLE_INPUTS)
                                        or recorded_example_inputs(graph_module))
        delegated = delegate_graph(graph_module, delegate, example, backend.name, keep_reference,
                                   backend.arithmetic, keep_regions, stored, progress=progress)

    copies: Copies = {}  # int8 copies of the snapshot's weights, shared by every reference form

    def lower_to_kernels(graph_module: fx.GraphModule) -> None:
        found["summary"] = lower_graph(graph_module, backend, keep_reference,
                                       replaced=lambda path: hold_weight_as_int8(graph_module, path, copies))

    # a delegating backend compiles its partitions first; the reference backend runs the reference
    # form itself: nothing to lower. A kernel backend lowers even with an empty kernel table, so
    # that its layers left in reference form are warned of and counted in the report.
    lowering = [delegate_partitions] if delegate is not None else []
    kernel_backend = delegate is None and backend.name != "reference"
    lowering += [lower_to_kernels] if lower and (backend.kernels or kernel_backend) else []
    run_passes(gm, [*lowering, *plugin_passes(backend, Stage.POST_CONVERT)])
    summary = found.get("summary", LoweringSummary())
    report = conversion_report(gm, backend.name, mode, regions,
                               {**{a: f"delegate:{p}" for a, p in delegated.lowered.items()}, **summary.lowered},
                               {**delegated.reference, **summary.reference}, delegated,
                               pattern_op_keys(backend.config), unrounded, work)
    gm.meta[REPORT] = report
    gm.meta[PARTITION_FORMS] = {p.name: delegated.graphs[p.name] for p in delegated.partitions}  # qp.compare
    refuse_torch_shipping(gm)  # torch.save and torch.jit.script point to qp.save
    if lowering:  # ops without packed weights dispatch on the global engine: pin the backend's
        pin_engine(gm, backend.engine)
    compute_in_float32(gm)  # its float ops feed quantize ops: float32 under the caller's autocast too
    # after the engine's hook, whose forward hook restores the engine when this one raises
    guard_input_names(gm, gm.meta.get(FIXED_KEYWORDS, {}))  # a misspelt or missing input: the inputs it takes, not forward()'s TypeError
    guard_exported_inputs(gm)  # what export assumed of an input: one qplug error at the call, not deep inside
    guard_input_dtypes(gm)  # a float16 input, a float mask for a bool one: one qplug error, not a runtime's
    explain_call_faults(gm)  # a call that fails inside: the input at fault (an id beyond the vocabulary), else the kernel
    hold_reference_forms_as_int8(gm, copies)  # the reference weights it no longer runs: int8 in RAM, as in the file
    give_back_freed_memory()  # the rounded float weights lowering let go of, from glibc's heap
    return report


def conversion_report(gm: fx.GraphModule, backend: str, mode: str, regions: dict[str, tuple[str, bool]],
                      kernels: dict[str, str], reference: dict[str, str],
                      delegated: DelegationSummary, pattern_ops: frozenset[str],
                      unrounded: list[str], work: dict[str, list[int | None]]) -> QuantizationReport:
    """The report of ``gm`` (in reference form where ``reference`` says so) lowered to ``kernels``:
    what convert and load attach, and what ``qplug report`` reads from a file's record.
    ``pattern_ops`` names what the backend's patterns name (:func:`pattern_op_keys`);
    ``unrounded``, the int8 layers whose output stays float (:func:`float_outputs`); ``work``
    what each op of the reference form holds (:func:`work_by_name`)."""
    opaque = {name: reason for name, _, reason in gm.meta.get(CAPTURE_SKIPPED, [])}
    return QuantizationReport(
        backend=backend, mode=_mode_of(mode, regions.values()), fusions=list(gm.meta.get(FUSIONS, [])),
        quantized={name: pattern for name, (pattern, _) in regions.items()}, kernels=kernels,
        reference=reference, skipped=float_compute_nodes(gm, reference, opaque, delegated.graphs,
                                                         frozenset(p.name for p in delegated.partitions),
                                                         pattern_ops),
        capture=gm.meta.get(CAPTURE, "symbolic"),
        partitions=[asdict(p) for p in delegated.partitions], outside=dict(delegated.outside),
        kept_regions=dict(delegated.kept_regions), notes=list(gm.meta.pop(CONVERSION_NOTES, [])),
        float_outputs=list(unrounded), work=work)


def float_outputs(gm: fx.GraphModule) -> list[str]:
    """The int8 layers (report names) whose output stays float: their backend dequantizes into
    them (``BackendSpec.float_outputs``), where a backend without float outputs, or
    ``backend="reference"``, rounds them to an 8-bit grid. Said in the report, since that grid is
    most of the difference between two backends' outputs (a regressor's head: 6x the error on
    held-out rows beyond its calibrated range)."""
    name = report_names(gm.graph)
    return [name(node) for node in gm.graph.nodes if is_float_output(gm, node)]


def quantized_regions(gm: fx.GraphModule) -> dict[str, tuple[str, bool]]:
    """anchor name (see report_names) -> (pattern name, is dynamic) for every int8 region."""
    report_key = report_names(gm.graph)
    return {report_key(node): (tag.pattern_name, tag.is_dynamic) for node in gm.graph.nodes
            if (tag := region_tag(node)) is not None and tag.is_anchor and tag.quantized}


def _mode_of(prepared_mode: str, regions) -> str:
    dynamic = [is_dynamic for _, is_dynamic in regions]
    if prepared_mode == "static" and dynamic and all(dynamic):
        return "dynamic"
    return prepared_mode
