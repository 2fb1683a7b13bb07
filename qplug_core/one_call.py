"""``qp.quantize``: static post-training quantization in one call, with the accuracy recipes.

The plain flow (:func:`qplug_core.flows.steps.quantize_static`) knows nothing of the algorithms, which are built
on it; this entry point picks between them: a recipe to run or an accuracy target to meet goes
through :mod:`qplug_core.algorithms`, anything else straight to the flow.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

from qplug_core.algorithms.architecture import looks_like_transformer, transformer_verdict
from qplug_core.algorithms.bias_correction import BiasCorrection, corrected_after_calibration
from qplug_core.algorithms.pipeline import prepare_algorithms, quantize_fused
from qplug_core.algorithms.recipes import RecipeRecord
from qplug_core.algorithms.target import (
    TARGET_MISSED,
    TRANSFORMER_TARGET,
    Target,
    meet_target,
    scored_embedding,
)
from qplug_core.config import QConfigMapping
from qplug_core.errors import ConfigValidationError, did_you_mean, notify, spelled, warn_user
from qplug_core.flows import auto, first_batch
from qplug_core.flows import checks as flow_checks
from qplug_core.flows import steps as flows
from qplug_core.flows.capture import generates
from qplug_core.flows.final_check import check_final_model
from qplug_core.flows.image_sizes import calibrated_sizes
from qplug_core.flows.lost_methods import lost_methods
from qplug_core.flows.method_views import method_view
from qplug_core.flows.pipeline import as_input_tuple, bound_batches, bound_to_forward
from qplug_core.flows.tags import RECIPE, REPORT, TARGET
from qplug_core.flows.weight_bits import backend_defaults, users_own
from qplug_core.registry.backends import Backend, get_backend, resolve_backend
from qplug_core.registry.cpu_diagnostics import warn_if_slow_here
from qplug_core.weight_only.w8a8 import quantize_w8a8


def quantize(model: nn.Module, example_inputs: Any, calibration_data: Any, *,
             backend: str | Backend | None = None, qconfig_mapping: QConfigMapping | None = None,
             progress: bool | None = None, strict: bool = False, allow_float: bool = False,
             recipe: Any = "auto", target: Any = None, **prepare_options: Any) -> nn.Module:
    """Static post-training quantization in one call: the int8 model running the backend's kernels.

    ``model`` may be an ``nn.Module``, an ``ExportedProgram`` or its ``.module()``;
    ``capture="auto"`` (a prepare option) traces symbolically when it can, else uses
    torch.export. With no int8 region at all it raises :class:`NothingQuantizedError` (the most
    frequent reasons ops stayed float in its message) unless ``allow_float=True``.

    ``recipe`` names algorithm passes run on the fused float model first ("dfq", "smoothquant",
    "none", a list of steps; "auto" picks SmoothQuant for transformers, bias correction otherwise);
    ``target=qp.Target(cosine=0.99)`` keeps the fewest layers float that reach it. See
    docs/guide/accuracy.md.

    ``backend="auto"`` calibrates once, finishes the reference form on every installed backend,
    checks each against it and keeps the fastest on ``example_inputs`` that keeps the kernel
    contract (:mod:`qplug_core.flows.auto`; the report's ``auto`` lists what was tried).

    A generating Hugging Face model (a ``PreTrainedModel`` with ``generate()``, such as
    ``LlamaForCausalLM`` or ``WhisperForConditionalGeneration``) is not captured: a graph has no
    ``generate()`` and no KV cache. With ``backend=None``, ``"auto"`` or a backend with kernels
    (fbgemm, qnnpack) and the default options it is quantized by
    :func:`qp.quantize_w8a8 <qplug_core.quantize_w8a8>` instead (SmoothQuant on ``calibration_data``,
    int8 weights and per-token int8 activations, the same model class back, with ``generate()``;
    ``example_inputs`` are not used). A delegating backend (``"onnxruntime"``, ``"openvino"``)
    compiles graphs, so there, as with ``capture="export"`` (or any graph-mode option), the model
    is captured: a ``GraphModule`` that cannot generate, with a warning saying so.

    Batches (``example_inputs`` and each calibration batch) are a tensor, a tuple of positional
    inputs or a dict of keyword inputs on either route: a captured graph takes positional inputs,
    so a dict whose keys are ``forward()``'s parameters is bound to them by name (parameters between
    them at their defaults), from a list, an iterator or a loader (a ``DataLoader``) of batches.

    A torch.export capture keeps image heights and widths dynamic when ``calibration_data`` (a
    list) holds images of several sizes and the exported graph answers each as the model does;
    ``dynamic_shapes=`` (torch.export's format, a prepare option) gives the dynamic sizes instead.
    """
    _check_options(prepare_options)
    view = method_view(model)  # a method or partial: no generate() path, its graph is what was asked
    if view is model and generates(model):
        measured = backend is None or backend == auto.AUTO  # W8A8 picks its kernels per CPU itself
        chosen = None if measured else resolve_backend(backend).require_available()
        compiles = chosen is not None and not chosen.kernels and chosen.delegate is not None
        if not (qconfig_mapping is not None or target is not None or recipe != "auto"
                or _graph_options(prepare_options) or strict or compiles):
            unused = "" if example_inputs is None else "; example_inputs are not used: module swap measures on calibration_data"
            notify(f"{type(model).__name__} generates text: quantized by module swap (qp.quantize_w8a8: "
                   "SmoothQuant, int8 weights, per-token int8 activations) so it keeps generate(); pass "
                   f"capture='export' for a captured graph instead{unused}")
            return quantize_w8a8(model, calibration_data, backend=None if chosen is None else chosen.name)
        keep = spelled("qp.quantize_w8a8(model, calibration) or qp.quantize_weights(model)",
                       "--mode w8a8 or --mode weight-only")
        warn_user(f"qp.quantize captures {type(model).__name__} as a graph, which has no generate() and no KV "
                  f"cache; {keep} keep the model and generate()")
    whole, model = view is model, view
    example_inputs, calibration_data = bound_to_forward(example_inputs, model), bound_batches(calibration_data, model)
    if not (isinstance(backend, str) and backend == auto.AUTO):  # auto measures every backend itself
        named = get_backend(backend)
        warn_if_slow_here(named.name, named.engine)
    with kv_cache_off(model) if generates(model) else contextlib.nullcontext(), \
            calibrated_sizes(_listed_batches(calibration_data, model)), first_batch.recording() as kept:
        qmodel = _quantize_graph(model, example_inputs, calibration_data, backend=backend,
                                 qconfig_mapping=qconfig_mapping, progress=progress, strict=strict,
                                 allow_float=allow_float, recipe=recipe, target=target, **prepare_options)
        if not _INSIDE_AUTO.get():  # auto checks the model it returns, not each base
            first_batch.take(qmodel)
            qmodel = check_final_model(qmodel, model, calibration_data, kept[0] if kept else None,
                                       scored_embedding(qmodel))
    if whole and isinstance(qmodel, fx.GraphModule) and not _INSIDE_AUTO.get():
        _warn_lost_methods(model, qmodel)
    return qmodel


def _warn_lost_methods(model: nn.Module, qmodel: fx.GraphModule) -> None:
    """Say which of the model's other methods the returned graph does not have, and the ways to keep them."""
    lost = lost_methods(model, qmodel)
    if not lost:
        return
    shown = ", ".join(f"{name}()" for name in lost[:4]) + (f" and {len(lost) - 4} more" if len(lost) > 4 else "")
    warn_user(f"qplug: qp.quantize returns a GraphModule of {type(model).__name__}.forward only: "
              f"{shown} {'is' if len(lost) == 1 else 'are'} not on it. Quantize a method as its own graph with "
              f"qp.quantize(model.{lost[0]}, example_inputs, calibration_data), or keep the model object with a "
              "module-swap route (qp.quantize_dynamic(model), qp.quantize_w8a8(model, calibration_data), "
              "qp.quantize_weights(model))")


#: set while backend="auto" quantizes its bases (each a qp.quantize call of its own)
_INSIDE_AUTO: contextvars.ContextVar[bool] = contextvars.ContextVar("inside_auto", default=False)


def _listed_batches(calibration_data: Any, model: nn.Module) -> list[tuple]:
    """The calibration batches of a list or tuple, whose image sizes an export capture may keep
    dynamic (:mod:`qplug_core.flows.image_sizes`); none of an iterator, which calibration reads once."""
    if not isinstance(calibration_data, (list, tuple)):
        return []
    return list(flows.iter_batches(calibration_data, model))


#: the keyword arguments qp.quantize passes on to prepare_fx (capture, on_unsupported, ...)
PREPARE_OPTIONS = tuple(name for name, parameter in inspect.signature(flows.prepare_fx).parameters.items()
                        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "backend")


def _graph_options(prepare_options: dict[str, Any]) -> list[str]:
    """The prepare options given other values than their defaults: asking for graph mode
    (``capture="auto"`` written out, as the CLI passes it, is still the default)."""
    defaults = inspect.signature(flows.prepare_fx).parameters
    return [name for name, value in prepare_options.items()
            if name not in defaults or defaults[name].default is inspect.Parameter.empty
            or not _same(value, defaults[name].default)]


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - a tensor or an object without a plain comparison: not the default
        return False


def _check_options(prepare_options: dict[str, Any]) -> None:
    """An unknown keyword names itself and its likely spelling, not prepare_fx's TypeError."""
    unknown = [name for name in prepare_options if name not in PREPARE_OPTIONS]
    if unknown:
        known = [*inspect.signature(quantize).parameters, *PREPARE_OPTIONS]
        raise ConfigValidationError(
            f"qp.quantize() got an unknown keyword argument {unknown[0]!r}{did_you_mean(unknown[0], known)}; "
            f"it takes {', '.join(n for n in known if n not in ('model', 'prepare_options'))}",
            field=unknown[0], value=prepare_options[unknown[0]])


@contextlib.contextmanager
def kv_cache_off(model: nn.Module) -> Iterator[None]:
    """The model's ``config.use_cache`` off while it is captured: a graph has no KV cache, and
    Hugging Face's ``DynamicCache`` is no output torch.export can return (it refused every
    generating model); the user's setting is restored after."""
    config = model.config
    had, before = hasattr(config, "use_cache"), getattr(config, "use_cache", None)
    config.use_cache = False
    try:
        yield
    finally:
        if had:
            config.use_cache = before
        else:
            del config.use_cache


def _quantize_graph(model: nn.Module, example_inputs: Any, calibration_data: Any, *,
                    backend: str | Backend | None, qconfig_mapping: QConfigMapping | None,
                    progress: bool | None, strict: bool, allow_float: bool, recipe: Any, target: Any,
                    **prepare_options: Any) -> nn.Module:
    """:func:`quantize` of a model captured as a graph (every model but a generating one kept whole)."""
    if isinstance(backend, str) and backend == auto.AUTO:
        return _quantize_auto(model, example_inputs, calibration_data, qconfig_mapping=qconfig_mapping,
                              progress=progress, strict=strict, allow_float=allow_float,
                              recipe=recipe, target=target, **prepare_options)
    if not needs_algorithms(model, recipe, target):
        if corrects_bias_by_default(model, recipe, target, qconfig_mapping):
            return _quantize_correcting_bias(model, example_inputs, calibration_data, backend=backend,
                                             qconfig_mapping=qconfig_mapping, progress=progress,
                                             strict=strict, allow_float=allow_float, **prepare_options)
        qmodel = flows.quantize_static(model, example_inputs, calibration_data, backend=backend,
                                       qconfig_mapping=qconfig_mapping, progress=progress, strict=strict,
                                       allow_float=allow_float, **prepare_options)
        if recipe == "auto" and users_own(qconfig_mapping):
            # even one equal to the backend's default: the two runs differ, and the report says why
            _say_recipe(qmodel, "none: a qconfig_mapping was given, which is quantized exactly as it "
                                "says (recipe='auto' corrects biases only with the backend's default "
                                "qconfigs); recipe='bias_correction' asks for it")
        return qmodel
    flow_checks.check_preparable(model)
    flow_checks.check_calibration_data(calibration_data)
    chosen = resolve_backend(backend).require_available()
    return quantize_with_algorithms(
        model, example_inputs, calibration_data, backend=chosen, qconfig_mapping=qconfig_mapping,
        recipe=recipe, target=target, progress=progress, strict=strict, allow_float=allow_float,
        prepare_options=prepare_options)


def _quantize_auto(model: nn.Module, example_inputs: Any, calibration_data: Any, *,
                   qconfig_mapping: QConfigMapping | None, **options: Any) -> fx.GraphModule:
    """``qp.quantize`` for the base backend, then the measured choice among all of them."""
    backends, untried = auto.candidates()
    if not backends:
        notify("backend='auto': no backend besides the reference form is available here; using it")
        return quantize(model, example_inputs, calibration_data, backend="reference",
                        qconfig_mapping=qconfig_mapping, **options)
    # with the user's mapping every candidate takes it: the first that quantizes every output
    bases = [next((b for b in backends if not b.float_outputs), backends[0]) if qconfig_mapping is not None
             else auto.base_backend(backends)]
    if qconfig_mapping is None and needs_algorithms(model, options.get("recipe", "auto"), options.get("target")):
        # a target's decisions measure each layer with the grids its backend keeps: each set of
        # float-output kinds gets its own base (see auto.float_output_bases)
        bases += auto.float_output_bases(backends, bases[0])
    if len(bases) > 1:  # each base calibrates: a generator would be spent after the first
        calibration_data, options["target"] = _reiterable(model, calibration_data, options.get("target"))
    calibrated = []
    for base in bases:
        # its kernels' warnings, and its target search's miss, count only if it (or a backend
        # finished from it) wins
        inside = _INSIDE_AUTO.set(True)
        try:
            with auto.held_warnings(base.name) as held, auto.held_target_warnings(TARGET_MISSED) as missed:
                qmodel = quantize(model, example_inputs, calibration_data, backend=base,
                                  qconfig_mapping=qconfig_mapping, **options)
        finally:
            _INSIDE_AUTO.reset(inside)
        calibrated.append(auto.Calibrated(qmodel, base, held, missed))
    others = [b for b in backends if b.name not in {base.name for base in bases}]
    return auto.choose(calibrated, others, untried, as_input_tuple(example_inputs, model),
                       auto.check_batches(calibration_data, model), float_model=model)


def _reiterable(model: nn.Module, calibration_data: Any, target: Any) -> tuple[list[tuple], Any]:
    """The calibration batches and the target's own ``data`` as lists, read once, for a path
    that reads them more than once (any iterable may be given, a generator too)."""
    flow_checks.check_calibration_data(calibration_data)
    batches = list(flows.iter_batches(calibration_data, model))
    if isinstance(target, Target) and target.data is not None:
        target = dataclasses.replace(target, data=list(flows.iter_batches(target.data, model)))
    return batches, target


def needs_algorithms(model: Any, recipe: Any, target: Any) -> bool:
    """Whether ``qp.quantize`` must take this path (a step to run or a target to meet)."""
    if target is not None:
        return True
    if recipe is None or recipe == "none":
        return False
    if recipe == "auto":
        return looks_like_transformer(model)
    return True


def corrects_bias_by_default(model: Any, recipe: Any, target: Any, qconfig_mapping: Any) -> bool:
    """``recipe="auto"`` on a model that is not a transformer, with the backend's own qconfigs
    (None, or ``backend_defaults``) and no target (a target's search decides per layer; a
    mapping of the user's own is quantized exactly as it says)."""
    if recipe != "auto" or target is not None or users_own(qconfig_mapping):
        return False
    return isinstance(model, (nn.Module, torch.export.ExportedProgram)) and not looks_like_transformer(model)


def _quantize_correcting_bias(model: Any, example_inputs: Any, calibration_data: Any, *,
                              backend: Any, qconfig_mapping: QConfigMapping | None,
                              **options: Any) -> fx.GraphModule:
    """The plain flow, with the mean output shift of each layer's int8 weights measured while it
    calibrates and removed from its bias before convert (ResNet-18 +1.5 dB held out; see
    :mod:`qplug_core.algorithms.bias_correction`)."""
    corrections: list[BiasCorrection] = []
    chosen = resolve_backend(backend)  # once: with backend=None it says which it picked

    def measure(observed: fx.GraphModule) -> Any:
        mapping = qconfig_mapping if qconfig_mapping is not None else backend_defaults(chosen)
        return corrected_after_calibration(observed, mapping, corrections)

    qmodel = flows.quantize_static(model, example_inputs, calibration_data, backend=chosen,
                                   qconfig_mapping=qconfig_mapping, while_calibrating=measure, **options)
    qmodel.meta[RECIPE] = RecipeRecord("auto: bias_correction", ("bias_correction",),
                                       {"bias_correction": corrections})
    _say_recipe(qmodel, f"auto: bias correction, no accuracy target: not a transformer "
                        f"({transformer_verdict(model)[1]}); target=qp.Target(...) asks for one")
    return qmodel


def quantize_with_algorithms(model: nn.Module, example_inputs: Any, calibration_data: Any, *,
                             backend: Any, qconfig_mapping: QConfigMapping | None, recipe: Any,
                             target: Any, progress: bool | None, strict: bool,
                             prepare_options: dict[str, Any], allow_float: bool = False) -> fx.GraphModule:
    options = dict(prepare_options)
    given = target is not None
    if recipe == "auto" and target is None and not strict and looks_like_transformer(model):
        # strict=True asks for every op in int8: a target that may keep layers out conflicts
        target = TRANSFORMER_TARGET
    gm, inputs, batches, mapping, record = prepare_algorithms(
        model, example_inputs, calibration_data, backend, qconfig_mapping, recipe, options)
    if target is None:
        qmodel = quantize_fused(gm, inputs, batches, backend, mapping, progress=progress,
                                strict=strict, allow_float=allow_float, prepare_options=options)
    else:
        qmodel = meet_target(gm, inputs, batches, backend, mapping, target, progress=progress,
                             strict=strict, prepare_options=options)
    qmodel.meta[RECIPE] = record
    parts = [record.name]
    if target is not None:
        parts.append(("the given " if given else "") + _target_text(qmodel))
    if recipe == "auto":
        transformer, why = transformer_verdict(model)
        parts.append(f"{'a' if transformer else 'not a'} transformer ({why})")
    _say_recipe(qmodel, "; ".join(parts))
    return qmodel


def _target_text(qmodel: fx.GraphModule) -> str:
    """The accuracy target searched, and whether it was met."""
    result = qmodel.meta[TARGET]
    target = result.target
    criteria = ", ".join(f"{name}={getattr(target, name)}" for name in ("cosine", "min_cosine", "sqnr", "neighbours")
                         if getattr(target, name) is not None)
    kept = f"{len(result.float_layers)} layer(s) kept out of static int8" if result.float_layers else "all int8"
    return f"target ({criteria}) {'met' if result.met else 'missed'}, {kept}"


def _say_recipe(qmodel: fx.GraphModule, text: str) -> None:
    """The report names the recipe and target applied, and why (a ViT got the CNN default silently)."""
    report = qmodel.meta.get(REPORT)
    if report is not None:
        report.recipe = text
