"""The graph-mode flows: fuse -> prepare -> calibrate -> convert -> lower, and ``quantize`` in one call.

Every entry point copies the user's model first (``inplace=False``), so the float model is never
modified, and records what it did in ``GraphModule.meta`` for the next step and the report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, ContextManager

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from qplug_core.config import QConfigMapping
from qplug_core.config.qconfig_mapping import require_mapping
from qplug_core.enums import Stage
from qplug_core.errors import (
    BackendUnavailableError,
    CalibrationError,
    ConfigValidationError,
    InputMismatchError,
    NothingQuantizedError,
    QplugError,
    first_line,
    spelled,
    warn_user,
)
from qplug_core.flows import calibration_sample, first_batch, weight_bits
from qplug_core.flows import checks as flow_checks
from qplug_core.flows.convert import convert_graph, rounded_weights
from qplug_core.flows.exported_inputs import guard_exported_inputs
from qplug_core.flows.final_check import check_converted
from qplug_core.flows.finish import finish_conversion
from qplug_core.flows.input_dtypes import guard_input_dtypes
from qplug_core.flows.int16_pairs import warn_needless_reduce_range, warn_saturating_pairs
from qplug_core.flows.kernel_check import remember_example
from qplug_core.flows.narrowed_ranges import reporting_narrowed
from qplug_core.flows.pipeline import (
    as_input_tuple,
    eval_mode,
    fuse_model,
    gc_paused,
    plugin_passes,
    run_passes,
)
from qplug_core.flows.prepare import ObserverInserter, swap_qat_modules, tag_regions
from qplug_core.flows.preserved_attributes import preserve
from qplug_core.flows.progress import shown
from qplug_core.flows.raise_aten import exported_module
from qplug_core.flows.regions import RegionPlanner
from qplug_core.flows.renamed_keywords import renamed_keywords
from qplug_core.flows.report import QuantizationReport, top_reasons
from qplug_core.flows.snapshot import keep_snapshot
from qplug_core.flows.tags import CAPTURE, FIRST_BATCH, REPORT, STATE, ValueAnnotator
from qplug_core.flows.torch_ao_keywords import refuses_torch_ao_keywords
from qplug_core.flows.torch_ao_models import refuse_torch_ao_models
from qplug_core.flows.untrained import unwatch, watch_untrained
from qplug_core.ir.copying import deepcopy_sharing
from qplug_core.nn.computed_weights import copy_model
from qplug_core.nn.copying import detach_from
from qplug_core.observers import distributed
from qplug_core.observers.base import ObserverBase
from qplug_core.observers.fake_quantize import FakeQuantizeBase
from qplug_core.observers.tokens import batch_token_mask, observing_tokens
from qplug_core.passes import PassResult
from qplug_core.registry.backends import Backend, get_backend, resolve_backend

_ON_UNSUPPORTED = ("warn", "raise", "skip")


def _annotate(gm: fx.GraphModule, example_inputs: tuple) -> None:
    placeholders = [str(node.target) for node in gm.graph.nodes if node.op == "placeholder"]
    n_inputs = len(placeholders)
    takes_any = any(name.startswith("*") and not name.startswith("**") for name in placeholders)  # *args
    if len(example_inputs) > n_inputs and not takes_any:
        raise InputMismatchError(
            f"{len(example_inputs)} example inputs given but the model's forward takes {n_inputs}; "
            "pass example_inputs as a tuple with one entry per positional input of forward")
    try:
        with torch.no_grad(), eval_mode(gm):  # prepare must not update BN statistics
            ValueAnnotator(gm).run(*example_inputs)
    except QplugError:
        raise
    except Exception as error:
        shapes = ", ".join(str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
                           for x in example_inputs)
        if any(x is None for x in example_inputs) and gm.meta.get(CAPTURE, "symbolic") == "symbolic":
            raise InputMismatchError(
                f"the captured graph cannot run on the example inputs ({shapes}): symbolic tracing takes "
                f"a None example input for a tensor, so `if x is not None` branches are traced the way the "
                f"model does not run ({type(error).__name__}: {str(error).splitlines()[0]}). Use capture='auto' "
                "or 'export', or leave the argument out so that its default is traced as a constant") from error
        raise InputMismatchError(
            f"the model cannot run on the example inputs ({shapes}): {type(error).__name__}: {error}. "
            + spelled("Pass example_inputs as a tuple of positional inputs of the right shapes.",
                      "Give --example-shape and --example-dtype once per input of forward, and for inputs whose "
                      "values matter (offsets, lengths, indices) --calibration FILE: its first batch is the "
                      "example (without it integer inputs are ones).")) from error


def _requests_quantization(mapping: QConfigMapping) -> bool:
    """Whether any entry of ``mapping`` is a qconfig. The annotating run tells prepare which values
    are tensors for the observers it places; a mapping of only ``None`` (``QConfigMapping()``)
    places none, so prepare then only fuses and, as torch.ao's, does not run the model."""
    return bool(flow_checks.mapping_qconfigs(mapping))


def _state(gm: fx.GraphModule) -> dict[str, Any]:
    refuse_torch_ao_models(gm)
    state = getattr(gm, "meta", {}).get(STATE)
    if state is None and any(isinstance(m, (ObserverBase, FakeQuantizeBase)) for m in gm.modules()):
        # torch.fx rebuilds a pickled GraphModule from its code: the graph's metadata is gone
        raise ConfigValidationError(
            "this model holds qplug's observers but not the rest of qplug's state, which pickling "
            "(torch.save / torch.load, pickle, copy across processes) drops: prepare the float model "
            "again and load this model's state_dict into it (observers and fake-quants included), "
            "then convert that", field="model")
    if state is None:
        raise ConfigValidationError(
            "this model was not prepared by qplug (no qplug state in GraphModule.meta); call "
            "qp.prepare_fx or qp.prepare_qat_fx first", field="model")
    return state


def get_default_qconfig_mapping(backend: str | Backend | None = None, mode: str = "static") -> QConfigMapping:
    """The backend's default QConfigMapping for ``mode`` ("static", "qat" or "dynamic")."""
    return get_backend(backend).default_qconfig_mapping(mode)


@refuses_torch_ao_keywords("fuse_custom_config", "backend_config")
def fuse_fx(model: nn.Module, example_inputs: Any = None, *, backend: str | Backend | None = None,
            is_qat: bool = False, inplace: bool = False, capture: str = "auto",
            non_traceable_module_names=(), non_traceable_module_classes=(),
            preserved_attributes=()) -> fx.GraphModule:
    """Capture ``model`` and fuse it with the backend's fusion patterns (conv-bn-relu, ...).

    ``capture``: "symbolic" (torch.fx tracing), "export" (torch.export, needs ``example_inputs``)
    or "auto" (symbolic when the whole model traces, else export); ``model`` may also be an
    ``ExportedProgram`` or its ``.module()``. ``gm.meta["qplug_capture"]`` says which was used.
    ``preserved_attributes``: names of ``model``'s attributes ``forward`` does not use (capture
    drops them) to set on the result, as torch.ao's ``set_preserved_attributes``.
    """
    inputs = None if example_inputs is None else as_input_tuple(example_inputs, model)
    gm = fuse_model(model, resolve_backend(backend), inputs, is_qat=is_qat, inplace=inplace,
                    capture=capture, non_traceable_module_names=non_traceable_module_names,
                    non_traceable_module_classes=non_traceable_module_classes)
    preserve(gm, model, preserved_attributes, copy_modules=not inplace)
    return gm


def _prepare(model, qconfig_mapping, example_inputs, *, backend, is_qat, inplace,
             keep_isolated_ops_float, on_unsupported, capture, non_traceable_module_names,
             non_traceable_module_classes, preserved_attributes, dynamic_shapes) -> fx.GraphModule:
    if isinstance(model, torch.export.ExportedProgram):
        model = exported_module(model)  # a fresh module: the program itself is never modified
    source, copy_modules = model, not inplace  # preserved attributes are read off the user's model
    flow_checks.check_preparable(model)
    flow_checks.check_float32(model)
    flow_checks.check_weight_values(model)
    if on_unsupported not in _ON_UNSUPPORTED:
        raise ConfigValidationError(f"on_unsupported must be one of {_ON_UNSUPPORTED}, got "
                                    f"{on_unsupported!r}", field="on_unsupported", value=on_unsupported)
    chosen = resolve_backend(backend)
    mode = "qat" if is_qat else "static"
    mapping = qconfig_mapping if qconfig_mapping is not None else chosen.default_qconfig_mapping(mode)
    mapping = require_mapping(mapping)
    if example_inputs is None and _requests_quantization(mapping):
        raise ConfigValidationError(
            "example_inputs is required: prepare runs the model once on them to learn which values are "
            "float tensors before placing observers; pass a tuple of positional inputs of forward, e.g. "
            "(x,) with x one batch (only a mapping that keeps every op float needs none)",
            field="example_inputs")
    flow_checks.warn_unknown_module_names(mapping, model)
    model_names = {name for name, _ in model.named_modules()}
    if is_qat:
        flow_checks.check_fake_quantizes(flow_checks.mapping_qconfigs(mapping), "prepare_qat_fx")
    inputs = as_input_tuple(example_inputs, model)
    if not is_qat and getattr(model, "training", False) and not inplace:  # PTQ folds batch norm
        model = copy_model(model).eval()
        inplace = True
    # the passes below recompile once at the end; nothing before them runs ``forward``
    gm = fuse_model(model, chosen, inputs, is_qat=is_qat, inplace=inplace, capture=capture,
                    non_traceable_module_names=non_traceable_module_names,
                    non_traceable_module_classes=non_traceable_module_classes, recompile=False,
                    dynamic_shapes=dynamic_shapes)
    _check_device(gm, chosen)
    flow_checks.warn_fused_away_module_names(mapping, model_names, gm)

    users_own = weight_bits.users_own(qconfig_mapping)

    def annotate(graph_module: fx.GraphModule) -> PassResult:
        if _requests_quantization(mapping):  # else no observer to place: prepare only fuses
            _annotate(graph_module, inputs)
        return PassResult(graph_module, False)  # only node.meta changes

    def observe(graph_module: fx.GraphModule) -> None:
        regions = RegionPlanner(graph_module, chosen, mapping, on_unsupported=on_unsupported,
                                keep_isolated_ops_float=keep_isolated_ops_float,
                                backend_defaults=not users_own).plan()
        if is_qat:
            swap_qat_modules(graph_module, regions)
        ObserverInserter(graph_module, is_qat=is_qat).insert(regions)
        tag_regions(regions)

    default = chosen.default_qconfig_mapping(mode) if users_own else None
    backend_passes = reporting_narrowed(chosen.name, plugin_passes(chosen, Stage.POST_PREPARE), users_own=users_own,
                                        default_qconfig=None if default is None else default.global_qconfig)
    run_passes(gm, [annotate, observe, warn_saturating_pairs(chosen.name, chosen.arithmetic),
                     warn_needless_reduce_range(chosen.name, chosen.arithmetic,
                                                has_kernels=bool(chosen.kernels or chosen.delegate)),
                     *backend_passes])
    gm.meta[STATE] = {"backend": chosen.name, "mode": mode}
    weight_bits.mark(gm, chosen, mode, user_mapping=users_own)
    remember_example(gm, inputs)
    guard_exported_inputs(gm)  # a calibration batch export cannot run refused, not run as the example
    guard_input_dtypes(gm, kinds_only=True)  # a float mask for a bool one refused naming the batch
    preserve(gm, source, preserved_attributes, copy_modules=copy_modules)
    if is_qat:
        watch_untrained(gm)
        gm.train()
    else:
        first_batch.watch(gm)  # its first calibration batch and float output: the final check's
    return gm


@refuses_torch_ao_keywords("prepare_custom_config", "backend_config", "_equalization_config")
def prepare_fx(model: nn.Module, qconfig_mapping: QConfigMapping | None = None, example_inputs: Any = None,
               *, backend: str | Backend | None = None, inplace: bool = False,
               keep_isolated_ops_float: bool = True, on_unsupported: str = "warn",
               capture: str = "auto", non_traceable_module_names=(),
               non_traceable_module_classes=(), preserved_attributes=(),
               dynamic_shapes: Any = None) -> fx.GraphModule:
    """Fuse and insert observers for static post-training quantization; returns the observed model.

    ``example_inputs`` (a tuple of positional inputs of ``forward``) is required: the model runs
    once on them. Only a mapping of ``None`` entries (prepare then only fuses) takes none.

    ``qconfig_mapping=None`` uses the backend's default static mapping. A qconfig the backend
    cannot honour leaves that op in float with a warning (``on_unsupported="raise"`` makes it a
    :class:`ConstraintViolationError`, ``"skip"`` only records it in the report).
    ``preserved_attributes`` names attributes of ``model`` to set on the observed model (and,
    through convert, on the int8 one) though ``forward`` does not use them, as torch.ao's
    ``set_preserved_attributes``. ``dynamic_shapes`` (torch.export's format, e.g.
    ``({2: 32 * Dim("h"), 3: 32 * Dim("w")},)``) is passed to a torch.export capture as given.
    """
    return _prepare(model, qconfig_mapping, example_inputs, backend=backend, is_qat=False,
                    inplace=inplace, keep_isolated_ops_float=keep_isolated_ops_float,
                    on_unsupported=on_unsupported, capture=capture,
                    non_traceable_module_names=non_traceable_module_names,
                    non_traceable_module_classes=non_traceable_module_classes,
                    preserved_attributes=preserved_attributes, dynamic_shapes=dynamic_shapes)


@refuses_torch_ao_keywords("prepare_custom_config", "backend_config", "_equalization_config")
def prepare_qat_fx(model: nn.Module, qconfig_mapping: QConfigMapping | None = None,
                   example_inputs: Any = None, *, backend: str | Backend | None = None,
                   inplace: bool = False, keep_isolated_ops_float: bool = True,
                   on_unsupported: str = "warn", capture: str = "auto",
                   non_traceable_module_names=(), non_traceable_module_classes=(),
                   preserved_attributes=(), dynamic_shapes: Any = None) -> fx.GraphModule:
    """Like :func:`prepare_fx` for quantization-aware training: fake-quant everywhere, QAT modules."""
    return _prepare(model, qconfig_mapping, example_inputs, backend=backend, is_qat=True,
                    inplace=inplace, keep_isolated_ops_float=keep_isolated_ops_float,
                    on_unsupported=on_unsupported, capture=capture,
                    non_traceable_module_names=non_traceable_module_names,
                    non_traceable_module_classes=non_traceable_module_classes,
                    preserved_attributes=preserved_attributes, dynamic_shapes=dynamic_shapes)


def iter_batches(data: Any, model: Any = None) -> Iterable[tuple]:
    """Calibration data as tuples of positional inputs: a bare tensor is one batch (a dict is refused
    with advice read off ``model``'s forward())."""
    if isinstance(data, torch.Tensor):
        yield (data,)
        return
    for batch in data:
        yield as_input_tuple(batch, model)


def _length(data: Any) -> int | None:
    """``len(data)`` for a progress bar's total; None without one (a DataLoader of an
    IterableDataset defines ``__len__`` and raises TypeError)."""
    try:
        return len(data)
    except TypeError:
        return None


@renamed_keywords(data="calibration_data")
def calibrate(model: nn.Module, calibration_data: Any, *, progress: bool | None = None) -> nn.Module:
    """Run calibration batches through an observed model (no gradients); returns the model.

    ``progress=None`` shows a rich progress bar only on a terminal (and only on rank 0). Under
    an initialized torch.distributed process group, observers agree across ranks as if one
    process saw every rank's batches together (docs/guide/distributed.md).
    """
    flow_checks.check_calibratable(model, calibration_data)
    show = shown(progress)
    total = None if isinstance(calibration_data, torch.Tensor) else _length(calibration_data)
    batches = non_empty = 0
    # observers see the float32 values the int8 model will compute from, whatever autocast is on
    with torch.no_grad(), torch.autocast("cpu", enabled=False), distributed.calibration_session(model) as ranks:
        if show:
            from rich.progress import track
            iterator = track(iter_batches(calibration_data, model), total=total, description="calibrating",
                             transient=True)
        else:
            iterator = iter_batches(calibration_data, model)
        sample = calibration_sample.start(model)  # a few batches for convert's decisions
        constant = flow_checks.ConstantInputs()
        for batch in ranks.steps(iterator):
            batches += 1
            constant.add(batch)
            if sample is not None:
                sample.add(batch)
            if any(isinstance(x, torch.Tensor) and x.numel() for x in pytree.tree_leaves(batch)):
                non_empty += 1  # tensors nested in dicts and lists count too
            try:
                with observing_tokens(batch_token_mask(model, batch)):  # padded tokens: not observed
                    model(*batch)
            except InputMismatchError as error:  # an input the capture cannot take (exported_inputs)
                flow_checks.mark_calibration_failed(model, error)
                raise InputMismatchError(f"calibration batch {batches - 1}: {error}") from error
            except QplugError as error:
                flow_checks.mark_calibration_failed(model, error)
                raise
            except Exception as error:
                flow_checks.mark_calibration_failed(model, error)
                raise batch_does_not_fit(batches - 1, error) from error
        non_empty = ranks.total(non_empty)
    if non_empty == 0 and batches == 0:  # "all empty" would blame batches that never came
        raise CalibrationError("calibration_data gave no batch (an empty list, or a generator or iterator "
                               "already used up: pass a list to read it more than once); calibration "
                               "needs at least one batch of representative inputs")
    if non_empty == 0:
        raise CalibrationError(f"0 batches observed ({batches} given, all empty): calibration needs "
                               "at least one batch of representative, non-empty inputs")
    if message := constant.warning(model):
        warn_user(message)
    return model


def batch_does_not_fit(index: int, error: Exception, *, detail: str = "",
                       give: str = "batches with the same number, shapes and dtypes of inputs as example_inputs "
                                   "(a graph captured by torch.export keeps the sizes its example had, unless "
                                   "they are dynamic)") -> InputMismatchError:
    """The error for a calibration batch the model raised on (torch's own error, first line, and
    ``detail`` on what is wrong with the batch), saying what to ``give``."""
    return InputMismatchError(f"calibration batch {index} does not fit the model: {type(error).__name__}: "
                              f"{first_line(error)}{detail}. Give {give}")


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
             inplace: bool, strict: bool, allow_float: bool = False, progress: bool | None = False,
             preserved_attributes: Any = ()) -> fx.GraphModule:
    """Convert to the reference form, keep it (what qp.save writes), then lower and report."""
    state = _state(observed)
    flow_checks.check_not_converted(observed)
    flow_checks.check_calibration_finished(observed)
    before = plugin_passes(backend, Stage.PRE_CONVERT)
    # a copy holds the weights convert replaces by rounded copies (it only reads them): no float
    # copy of every weight at the peak; a plugin pass before convert might write them
    shared = [] if inplace or before else rounded_weights(observed)
    with gc_paused():
        gm = observed if inplace else deepcopy_sharing(observed, shared)
    unwatch(gm)
    first_batch.unwatch(gm)
    kept = first_batch.take(gm)  # not in the snapshot: back on the model after, for the final check

    def convert(graph_module: fx.GraphModule) -> None:
        convert_graph(graph_module, allow_uncalibrated=allow_uncalibrated)
        if shared:
            detach_from(observed, graph_module)  # a weight convert left float: the copy's own
        keep_snapshot(graph_module, backend)

    # in float32 whatever autocast the caller has on: the kernel checks run the int8 model, and a
    # delegate's export traced bfloat16 casts (fbgemm raised; ONNX Runtime compiled nothing)
    with torch.autocast("cpu", enabled=False):
        run_passes(gm, [*before, convert])
        report = finish_conversion(gm, backend, mode=state["mode"], lower=lower, progress=progress)
    if strict and report.skipped:
        listed = "; ".join(f"{s.node} ({s.op}): {s.reason}" for s in report.skipped[:5])
        raise ConfigValidationError(f"strict=True but {len(report.skipped)} op(s) stay float: {listed}",
                                    field="strict")
    if not report.quantized and not allow_float:
        raise_nothing_quantized(report, backend)
    preserve(gm, observed, preserved_attributes, copy_modules=not inplace)
    if kept is not None and lower:  # a reference form is not checked against itself
        first_batch.take(observed)  # the check is its last use: the observed model lets it go too
        gm.meta[FIRST_BATCH] = kept
    return gm


def raise_nothing_quantized(report: QuantizationReport, backend: Backend | None = None) -> None:
    """NothingQuantizedError naming why ops stayed float: a float model must not pass as int8.

    A backend whose plugin failed (a hook raised) is named first, with the plugin and the hook:
    its missing patterns are then the likely reason, not the model."""
    reasons = top_reasons(report)
    listed = "; ".join(f"{reason} ({count} op(s))" for reason, count in reasons) or "no ops found"
    problems = list(backend.problems) if backend is not None else []
    broken = (f"backend {report.backend!r} is broken: {problems[0]}"
              f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}. " if problems else "")
    raise NothingQuantizedError(
        f"nothing was quantized: 0 int8 regions ({report.capture} capture, backend "
        f"{report.backend!r}). {broken}Top reasons ops stayed float: {listed}. Pass "
        "allow_float=True to accept a float result.", reasons=reasons) from (
        problems[0] if problems else None)


@refuses_torch_ao_keywords("convert_custom_config", "backend_config", "is_reference", "qconfig_mapping",
                           "_remove_qconfig", defaults={"is_reference": True})
def convert_to_reference_fx(observed: fx.GraphModule, *, allow_uncalibrated: bool = False,
                            inplace: bool = False, strict: bool = False,
                            allow_float: bool = False, preserved_attributes=()) -> fx.GraphModule:
    """Observed model -> reference int8 model (q/dq around float ops) that runs anywhere.

    A result with no int8 region raises :class:`NothingQuantizedError` unless ``allow_float``.
    ``preserved_attributes`` as for :func:`convert_fx`.
    """
    return _convert(observed, get_backend("reference"), lower=False,
                    allow_uncalibrated=allow_uncalibrated, inplace=inplace, strict=strict,
                    allow_float=allow_float, preserved_attributes=preserved_attributes)


@refuses_torch_ao_keywords("convert_custom_config", "backend_config", "is_reference", "qconfig_mapping",
                           "_remove_qconfig", "keep_original_weights")
def convert_fx(observed: fx.GraphModule, *, backend: str | Backend | None = None,
               allow_uncalibrated: bool = False, inplace: bool = False, strict: bool = False,
               allow_float: bool = False, progress: bool | None = None,
               preserved_attributes=()) -> fx.GraphModule:
    """Observed model -> int8 model running the backend's kernels (reference form where none exists).

    ``backend=None`` uses the backend the model was prepared for. ``strict=True`` raises when any
    compute op is left in float; a result with no int8 region at all raises
    :class:`NothingQuantizedError` unless ``allow_float=True``. ``progress`` shows the delegated
    partitions compiled and checked on stderr (``None``: on a terminal only; a line each where
    stderr is not one and ``progress=True``). The attributes the observed model keeps
    (``preserved_attributes=`` at prepare) stay on the result, with those ``preserved_attributes``
    names here, read off ``observed``.
    """
    state = _state(observed)
    chosen = get_backend(backend if backend is not None else state["backend"]).require_available()
    _check_device(observed, chosen)
    qmodel = _convert(observed, chosen, lower=True, allow_uncalibrated=allow_uncalibrated,
                      inplace=inplace, strict=strict, allow_float=allow_float, progress=progress,
                      preserved_attributes=preserved_attributes)
    return check_converted(qmodel)


def quantization_report(model: fx.GraphModule) -> QuantizationReport:
    """The report a convert step attached to ``model``."""
    report = getattr(model, "meta", {}).get(REPORT)
    if report is None:
        raise ConfigValidationError(f"this model has no qplug quantization report: {_made_by(model)}",
                                    field="model")
    return report


def _made_by(model: Any) -> str:
    """Why a model has no graph report (``qp.quantization_report`` reads a module-swap model's own
    record or modules before asking here)."""
    return "it was not produced by qplug (qp.quantize, qp.convert_fx, qp.quantize_dynamic, qp.quantize_weights)"


def quantize_static(model: nn.Module, example_inputs: Any, calibration_data: Any, *,
             backend: str | Backend | None = None, qconfig_mapping: QConfigMapping | None = None,
             progress: bool | None = None, strict: bool = False, allow_float: bool = False,
             while_calibrating: Callable[[fx.GraphModule], ContextManager[Any]] | None = None,
             **prepare_options: Any) -> fx.GraphModule:
    """Static post-training quantization in one call, without accuracy recipes (``qp.quantize``
    adds them: :mod:`qplug_core.one_call`).

    ``model`` may be an ``nn.Module``, an ``ExportedProgram`` or its ``.module()``;
    ``capture="auto"`` (a prepare option) traces symbolically when it can, else uses
    torch.export. With no int8 region at all it raises :class:`NothingQuantizedError` (the most
    frequent reasons ops stayed float in its message) unless ``allow_float=True``.
    ``while_calibrating(observed)`` is a context calibration runs in (a pass measuring what the
    calibration batches do to the observed model, such as the default bias correction).
    """
    flow_checks.check_preparable(model)
    flow_checks.check_calibration_data(calibration_data)
    chosen = resolve_backend(backend)
    chosen.require_available()
    observed = prepare_fx(model, qconfig_mapping, example_inputs, backend=chosen, **prepare_options)
    with contextlib.nullcontext() if while_calibrating is None else while_calibrating(observed):
        calibrate(observed, calibration_data, progress=progress)
    return convert_fx(observed, backend=chosen, inplace=True, strict=strict, allow_float=allow_float,
                      progress=progress)
