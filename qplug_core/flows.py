"""The graph-mode flows: fuse -> prepare -> calibrate -> convert -> lower, and ``quantize`` in one call.

Every entry point copies the user's model first (``inplace=False``), so the float model is never
modified, and records what it did in ``GraphModule.meta`` for the next step and the report.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx, nn

from qplug_core.backend import Backend, get_backend
from qplug_core.config import QConfigMapping
from qplug_core.errors import (
    BackendUnavailableError,
    CalibrationError,
    ConfigValidationError,
    InputMismatchError,
    QplugError,
)
from qplug_core.fx.convert import convert_graph
from qplug_core.fx.fuse import fuse_graph
from qplug_core.fx.leaves import leaf_module_classes
from qplug_core.fx.lower import LoweringSummary, lower_graph
from qplug_core.fx.normalize import normalize_functionals
from qplug_core.fx.prepare import ObserverInserter, swap_qat_modules, tag_regions
from qplug_core.fx.regions import RegionPlanner
from qplug_core.fx.summary import REPORT_KEY, QuantizationReport, float_compute_nodes
from qplug_core.fx.tags import ValueAnnotator, region_tag
from qplug_core.ir.capture import capture_module
from qplug_core.passes import PassManager, PassResult
from qplug_core.serialization import record_artifact

_STATE_KEY = "qplug_state"
_ON_UNSUPPORTED = ("warn", "raise", "skip")


def run_passes(gm: fx.GraphModule, passes: list) -> None:
    """Run flow passes in place through the PassManager (lint after each pass under QPLUG_DEBUG)."""
    debug = os.environ.get("QPLUG_DEBUG") == "1"
    with _gc_paused():
        PassManager(passes, inplace=True, run_checks_after_each_pass=debug)(gm)


@contextlib.contextmanager
def _gc_paused():
    """Pause Python's cyclic GC while a flow copies, traces or rewrites thousands of nodes.

    Graph rewriting allocates many long-lived objects, which triggers repeated full collections
    that scan the whole growing graph: measured 34% of prepare_fx at 5,600 nodes, and the only
    superlinear term. Reference counting still frees everything; the GC resumes afterwards.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def as_input_tuple(example_inputs: Any) -> tuple:
    """``example_inputs`` as a tuple of positional inputs (a bare tensor counts as a 1-tuple)."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def resolve_backend(backend: str | Backend | None) -> Backend:
    """The Backend to use; with ``None`` the best one for this machine, announced on stderr."""
    chosen = get_backend(backend)
    if backend is None:
        print(f"qplug: using backend {chosen.name!r} (pass backend=... to choose)", file=sys.stderr)
    return chosen


def _capture(model: nn.Module, *, inplace: bool, non_traceable_module_names=(),
             non_traceable_module_classes=()) -> fx.GraphModule:
    if not isinstance(model, nn.Module):
        raise ConfigValidationError(f"model must be a torch.nn.Module, got {type(model).__name__}",
                                    field="model", value=type(model).__name__)
    with _gc_paused():
        source = model if inplace else copy.deepcopy(model)
        if isinstance(source, fx.GraphModule):
            return source
        return capture_module(source, leaf_modules=leaf_module_classes(),
                              non_traceable_module_names=non_traceable_module_names,
                              non_traceable_module_classes=non_traceable_module_classes)


def _annotate(gm: fx.GraphModule, example_inputs: tuple) -> None:
    n_inputs = sum(node.op == "placeholder" for node in gm.graph.nodes)
    if len(example_inputs) > n_inputs:
        raise InputMismatchError(
            f"{len(example_inputs)} example inputs given but the model's forward takes {n_inputs}; "
            "pass example_inputs as a tuple with one entry per positional input of forward")
    try:
        with torch.no_grad():
            ValueAnnotator(gm).run(*example_inputs)
    except QplugError:
        raise
    except Exception as error:
        shapes = ", ".join(str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
                           for x in example_inputs)
        raise InputMismatchError(
            f"the model cannot run on the example inputs ({shapes}): {type(error).__name__}: {error}. "
            "Pass example_inputs as a tuple of positional inputs of the right shapes.") from error


def _state(gm: fx.GraphModule) -> dict[str, Any]:
    state = getattr(gm, "meta", {}).get(_STATE_KEY)
    if state is None:
        raise ConfigValidationError(
            "this model was not prepared by qplug (no qplug state in GraphModule.meta); call "
            "qp.prepare_fx or qp.prepare_qat_fx first", field="model")
    return state


def get_default_qconfig_mapping(backend: str | Backend | None = None, mode: str = "static") -> QConfigMapping:
    """The backend's default QConfigMapping for ``mode`` ("static", "qat" or "dynamic")."""
    return get_backend(backend).default_qconfig_mapping(mode)


def fuse_fx(model: nn.Module, example_inputs: Any = None, *, backend: str | Backend | None = None,
            is_qat: bool = False, inplace: bool = False, non_traceable_module_names=(),
            non_traceable_module_classes=()) -> fx.GraphModule:
    """Capture ``model`` and fuse it with the backend's fusion patterns (conv-bn-relu, ...)."""
    chosen = resolve_backend(backend)
    gm = _capture(model, inplace=inplace, non_traceable_module_names=non_traceable_module_names,
                  non_traceable_module_classes=non_traceable_module_classes)

    def fuse(graph_module: fx.GraphModule) -> None:
        graph_module.meta["qplug_fusions"] = fuse_graph(graph_module, chosen, is_qat=is_qat)

    run_passes(gm, [*chosen.passes("pre_fuse"), normalize_functionals, fuse])
    return gm


def _prepare(model, qconfig_mapping, example_inputs, *, backend, is_qat, inplace,
             keep_isolated_ops_float, on_unsupported, non_traceable_module_names,
             non_traceable_module_classes) -> fx.GraphModule:
    if on_unsupported not in _ON_UNSUPPORTED:
        raise ConfigValidationError(f"on_unsupported must be one of {_ON_UNSUPPORTED}, got "
                                    f"{on_unsupported!r}", field="on_unsupported", value=on_unsupported)
    chosen = resolve_backend(backend)
    mode = "qat" if is_qat else "static"
    mapping = qconfig_mapping if qconfig_mapping is not None else chosen.default_qconfig_mapping(mode)
    if not isinstance(mapping, QConfigMapping):
        raise ConfigValidationError(f"qconfig_mapping must be a QConfigMapping, got "
                                    f"{type(mapping).__name__}", field="qconfig_mapping")
    inputs = as_input_tuple(example_inputs)
    if not is_qat and model.training and not inplace:  # PTQ folds batch norm: eval semantics
        model = copy.deepcopy(model).eval()
        inplace = True
    gm = fuse_fx(model, inputs, backend=chosen, is_qat=is_qat, inplace=inplace,
                 non_traceable_module_names=non_traceable_module_names,
                 non_traceable_module_classes=non_traceable_module_classes)
    _check_device(gm, chosen)

    def annotate(graph_module: fx.GraphModule) -> PassResult:
        _annotate(graph_module, inputs)
        return PassResult(graph_module, False)  # only node.meta changes

    def observe(graph_module: fx.GraphModule) -> None:
        regions = RegionPlanner(graph_module, chosen, mapping, on_unsupported=on_unsupported,
                                keep_isolated_ops_float=keep_isolated_ops_float).plan()
        if is_qat:
            swap_qat_modules(graph_module, regions)
        ObserverInserter(graph_module, is_qat=is_qat).insert(regions)
        tag_regions(regions)

    run_passes(gm, [annotate, observe, *chosen.passes("post_prepare")])
    gm.meta[_STATE_KEY] = {"backend": chosen.name, "mode": mode}
    if is_qat:
        gm.train()
    return gm


def prepare_fx(model: nn.Module, qconfig_mapping: QConfigMapping | None = None, example_inputs: Any = None,
               *, backend: str | Backend | None = None, inplace: bool = False,
               keep_isolated_ops_float: bool = True, on_unsupported: str = "warn",
               non_traceable_module_names=(), non_traceable_module_classes=()) -> fx.GraphModule:
    """Fuse and insert observers for static post-training quantization; returns the observed model.

    ``qconfig_mapping=None`` uses the backend's default static mapping. A qconfig the backend
    cannot honour leaves that op in float with a warning (``on_unsupported="raise"`` makes it a
    :class:`ConstraintViolationError`, ``"skip"`` only records it in the report).
    """
    return _prepare(model, qconfig_mapping, example_inputs, backend=backend, is_qat=False,
                    inplace=inplace, keep_isolated_ops_float=keep_isolated_ops_float,
                    on_unsupported=on_unsupported, non_traceable_module_names=non_traceable_module_names,
                    non_traceable_module_classes=non_traceable_module_classes)


def prepare_qat_fx(model: nn.Module, qconfig_mapping: QConfigMapping | None = None,
                   example_inputs: Any = None, *, backend: str | Backend | None = None,
                   inplace: bool = False, keep_isolated_ops_float: bool = True,
                   on_unsupported: str = "warn", non_traceable_module_names=(),
                   non_traceable_module_classes=()) -> fx.GraphModule:
    """Like :func:`prepare_fx` for quantization-aware training: fake-quant everywhere, QAT modules."""
    return _prepare(model, qconfig_mapping, example_inputs, backend=backend, is_qat=True,
                    inplace=inplace, keep_isolated_ops_float=keep_isolated_ops_float,
                    on_unsupported=on_unsupported, non_traceable_module_names=non_traceable_module_names,
                    non_traceable_module_classes=non_traceable_module_classes)


def iter_batches(data: Any) -> Iterable[tuple]:
    """Calibration data as tuples of positional inputs: a bare tensor is one batch."""
    if isinstance(data, torch.Tensor):
        yield (data,)
        return
    for batch in data:
        yield as_input_tuple(batch)


def calibrate(model: nn.Module, data: Any, *, progress: bool | None = None) -> nn.Module:
    """Run calibration batches through an observed model (no gradients); returns the model.

    ``progress=None`` shows a rich progress bar only on a terminal.
    """
    show = sys.stderr.isatty() if progress is None else progress
    total = len(data) if hasattr(data, "__len__") and not isinstance(data, torch.Tensor) else None
    batches = non_empty = 0
    with torch.no_grad():
        if show:
            from rich.progress import track
            iterator = track(iter_batches(data), total=total, description="calibrating",
                             transient=True)
        else:
            iterator = iter_batches(data)
        for batch in iterator:
            batches += 1
            if any(isinstance(x, torch.Tensor) and x.numel() for x in batch):
                non_empty += 1
            try:
                model(*batch)
            except QplugError:
                raise
            except Exception as error:
                raise InputMismatchError(
                    f"calibration batch {batches - 1} does not fit the model: {type(error).__name__}: "
                    f"{str(error).splitlines()[0] if str(error) else ''}. Give batches with the same "
                    "number, shapes and dtypes of inputs as example_inputs") from error
    if non_empty == 0:
        raise CalibrationError(f"0 batches observed ({batches} given, all empty): calibration needs "
                               "at least one batch of representative, non-empty inputs")
    return model


def _check_device(gm: fx.GraphModule, backend: Backend) -> None:
    if backend.engine is None:
        return
    devices = {p.device.type for p in gm.parameters()} | {b.device.type for b in gm.buffers()}
    if devices - {"cpu"}:
        raise BackendUnavailableError(
            f"backend {backend.name!r} runs on the CPU but the model has tensors on "
            f"{sorted(devices - {'cpu'})}; move it with model.cpu() before quantizing",
            backend=backend.name)


def _convert(observed: fx.GraphModule, backend: Backend, *, lower: bool, allow_uncalibrated: bool,
             inplace: bool, strict: bool) -> fx.GraphModule:
    """Convert to the reference form, keep the save artifact, then lower and report."""
    state = _state(observed)
    with _gc_paused():
        gm = observed if inplace else copy.deepcopy(observed)

    def convert(graph_module: fx.GraphModule) -> None:
        convert_graph(graph_module, allow_uncalibrated=allow_uncalibrated)
        record_artifact(graph_module, backend)

    run_passes(gm, [*backend.passes("pre_convert"), convert])
    report = finish_conversion(gm, backend, mode=state["mode"], lower=lower)
    if strict and report.skipped:
        listed = "; ".join(f"{s.node} ({s.op}): {s.reason}" for s in report.skipped[:5])
        raise ConfigValidationError(f"strict=True but {len(report.skipped)} op(s) stay float: {listed}",
                                    field="strict")
    return gm


def finish_conversion(gm: fx.GraphModule, backend: Backend, *, mode: str,
                      lower: bool = True) -> QuantizationReport:
    """Lower a reference-form model to ``backend`` (post_convert passes too) and attach its report.

    Shared by convert_fx and qp.load, which rebuilds the reference form from a file.
    """
    regions = _quantized_regions(gm)
    found: dict[str, LoweringSummary] = {}

    def lower_to_kernels(graph_module: fx.GraphModule) -> None:
        found["summary"] = lower_graph(graph_module, backend)

    # a backend without kernels (reference) runs the reference form itself: nothing to lower
    lowering = [lower_to_kernels] if lower and backend.kernels else []
    run_passes(gm, [*lowering, *backend.passes("post_convert")])
    summary = found.get("summary", LoweringSummary())
    report = QuantizationReport(
        backend=backend.name, mode=_mode_of(mode, regions.values()),
        fusions=list(gm.meta.get("qplug_fusions", [])),
        quantized={name: pattern for name, (pattern, _) in regions.items()},
        kernels=dict(summary.lowered), reference=dict(summary.reference),
        skipped=float_compute_nodes(gm, summary.reference))
    gm.meta[REPORT_KEY] = report
    return report


def _quantized_regions(gm: fx.GraphModule) -> dict[str, tuple[str, bool]]:
    """anchor node name -> (pattern name, is dynamic) for every int8 region."""
    return {node.name: (tag.pattern_name, tag.is_dynamic) for node in gm.graph.nodes
            if (tag := region_tag(node)) is not None and tag.is_anchor and tag.quantized}


def _mode_of(prepared_mode: str, regions) -> str:
    dynamic = [is_dynamic for _, is_dynamic in regions]
    if prepared_mode == "static" and dynamic and all(dynamic):
        return "dynamic"
    return prepared_mode


def convert_to_reference_fx(observed: fx.GraphModule, *, allow_uncalibrated: bool = False,
                            inplace: bool = False, strict: bool = False) -> fx.GraphModule:
    """Observed model -> reference int8 model (q/dq around float ops) that runs anywhere."""
    return _convert(observed, get_backend("reference"), lower=False,
                    allow_uncalibrated=allow_uncalibrated, inplace=inplace, strict=strict)


def convert_fx(observed: fx.GraphModule, *, backend: str | Backend | None = None,
               allow_uncalibrated: bool = False, inplace: bool = False, strict: bool = False
               ) -> fx.GraphModule:
    """Observed model -> int8 model running the backend's kernels (reference form where none exists).

    ``backend=None`` uses the backend the model was prepared for. ``strict=True`` raises when any
    compute op is left in float.
    """
    state = _state(observed)
    chosen = get_backend(backend if backend is not None else state["backend"]).require_available()
    _check_device(observed, chosen)
    return _convert(observed, chosen, lower=True, allow_uncalibrated=allow_uncalibrated,
                    inplace=inplace, strict=strict)


def quantization_report(model: fx.GraphModule) -> QuantizationReport:
    """The report a convert step attached to ``model``."""
    report = getattr(model, "meta", {}).get(REPORT_KEY)
    if report is None:
        raise ConfigValidationError("this model has no qplug quantization report; it was not "
                                    "produced by qp.convert_fx / qp.quantize", field="model")
    return report


def quantize(model: nn.Module, example_inputs: Any, calibration_data: Any, *,
             backend: str | Backend | None = None, qconfig_mapping: QConfigMapping | None = None,
             progress: bool | None = None, strict: bool = False, recipe: Any = "auto",
             target: Any = None, **prepare_options: Any) -> fx.GraphModule:
    """Static post-training quantization in one call: the int8 model running the backend's kernels.

    ``recipe`` names algorithm passes run on the fused float model first ("dfq", "smoothquant",
    "none", a list of steps; "auto" picks SmoothQuant for transformers, nothing otherwise);
    ``target=qp.Target(cosine=0.99)`` keeps the fewest layers float that reach it. See
    docs/guide/accuracy.md.
    """
    chosen = resolve_backend(backend)
    chosen.require_available()
    from qplug_core.algorithms.pipeline import (
        needs_algorithms,
        quantize_with_algorithms,
    )

    if needs_algorithms(model, recipe, target):
        return quantize_with_algorithms(
            model, example_inputs, calibration_data, backend=chosen, qconfig_mapping=qconfig_mapping,
            recipe=recipe, target=target, progress=progress, strict=strict,
            prepare_options=prepare_options)
    observed = prepare_fx(model, qconfig_mapping, example_inputs, backend=chosen, **prepare_options)
    calibrate(observed, calibration_data, progress=progress)
    return convert_fx(observed, backend=chosen, inplace=True, strict=strict)
