"""Which level of the same IR a model is quantized at: symbolic tracing or torch.export.

``capture="auto"`` traces symbolically when the whole model traces, otherwise exports it with
``torch.export`` and raises the ATen graph to the pattern set's level (:mod:`.raise_aten`); when
both fail, the submodules that stop tracing stay opaque and the report names them.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
from torch import nn
from torch.fx import GraphModule

from qplug_core.errors import ConfigValidationError, TraceError, first_line, warn_user
from qplug_core.flows.capture_failure import both_failed
from qplug_core.flows.fixed_keywords import fixed_keywords
from qplug_core.flows.float_reference import float_like_int8
from qplug_core.flows.image_sizes import image_sizes, sizes_seen
from qplug_core.flows.raise_aten import exported_module, is_aten_graph, raise_aten_graph
from qplug_core.flows.tags import CAPTURE, CAPTURE_SKIPPED, FIXED_KEYWORDS
from qplug_core.ir.capture import (
    capture_module,
    export_images_dynamic,
    export_module,
    export_with_shapes,
    is_image,
    widened_ones,
)

__all__ = ["CAPTURE_LEVELS", "capture_for_quantization", "generates"]

#: the values of ``capture=`` every graph-mode flow accepts
CAPTURE_LEVELS = ("auto", "symbolic", "export")
_MAX_OPAQUE_MODULES = 16


def capture_for_quantization(model: nn.Module, example_inputs: tuple[Any, ...] | None, *,
                             level: str = "auto", leaf_modules: Sequence[type[nn.Module]] = (),
                             non_traceable_module_names: Sequence[str] = (),
                             non_traceable_module_classes: Sequence[type[nn.Module]] = (),
                             generate_code: bool = True, dynamic_shapes: Any = None) -> GraphModule:
    """The GraphModule the flows quantize, at the pattern set's level whatever the capture.

    ``level="auto"`` traces symbolically when the whole model traces (and no example input is
    ``None``), else exports it with ``torch.export`` and raises the ATen graph
    (:mod:`qplug_core.flows.raise_aten`); when both fail,
    the submodules that stop symbolic tracing stay opaque and are listed in
    ``meta[CAPTURE_SKIPPED]`` (the report names them). An ``ExportedProgram`` or its
    ``.module()`` is accepted as is. ``meta[CAPTURE]`` says which level was used.
    ``generate_code=False``: a traced graph's ``forward`` is generated at first use, for a caller
    whose passes rewrite the graph and recompile (:mod:`qplug_core.ir.deferred_code`).
    ``dynamic_shapes`` (torch.export's format) is passed to an export capture as given; without
    it, images of several sizes in the calibration data (:mod:`.image_sizes`) are tried dynamic.
    """
    if level not in CAPTURE_LEVELS:
        raise ConfigValidationError(f"capture must be one of {CAPTURE_LEVELS}, got {level!r}",
                                    field="capture", value=level)
    _check_dynamic_shapes(dynamic_shapes, example_inputs, model, level)
    if isinstance(model, torch.export.ExportedProgram):
        model = exported_module(model)
    if is_aten_graph(model):
        return _tagged(raise_aten_graph(model).graph_module, "export")
    if isinstance(model, GraphModule):
        return _tagged(model, "symbolic")
    gm = _capture_module(model, example_inputs, level, leaf_modules, non_traceable_module_names,
                         non_traceable_module_classes, generate_code, dynamic_shapes)
    if example_inputs is not None:
        gm.meta[FIXED_KEYWORDS] = fixed_keywords(model, len(example_inputs))
    return gm


def _capture_module(model: nn.Module, example_inputs: tuple[Any, ...] | None, level: str,
                    leaf_modules: Sequence[type[nn.Module]], non_traceable_module_names: Sequence[str],
                    non_traceable_module_classes: Sequence[type[nn.Module]], generate_code: bool,
                    dynamic_shapes: Any) -> GraphModule:
    """:func:`capture_for_quantization` of a module (not yet a graph)."""
    trace = {"leaf_modules": leaf_modules, "non_traceable_module_names": non_traceable_module_names,
             "non_traceable_module_classes": non_traceable_module_classes,
             "generate_code": generate_code, "concrete_args": defaults_not_given(model, example_inputs)}
    if level == "symbolic":
        return _tagged(_symbolic(model, trace), "symbolic")
    if level == "export":
        return _tagged(_raised_export(model, _require_inputs(example_inputs, level), dynamic_shapes)[0], "export")
    nones = [name for name, value in _named(model, example_inputs or ()) if value is None]
    if nones:
        try:  # symbolic tracing takes a None given as an input for a tensor: `if mask is not None` is
            exported, fixed = _raised_export(model, example_inputs, dynamic_shapes)  # traced the wrong way
        except TraceError as error:
            _warn_none_inputs(model, nones, error)
        else:
            _warn_none_inputs(model, nones, None)
            _warn_fixed_image_sizes(model, example_inputs, f"its example input {nones[0]} is None", fixed)
            return _tagged(exported, "export")
    try:
        traced = _symbolic(model, trace)
    except TraceError as symbolic_error:
        if example_inputs is None:
            raise TraceError(f"{symbolic_error} Or pass example_inputs so that qplug can capture the "
                             "model with torch.export.", module=symbolic_error.module) from symbolic_error
        try:
            exported, fixed = _raised_export(model, example_inputs, dynamic_shapes)
        except TraceError as export_error:
            return _partly_opaque(model, trace, symbolic_error, export_error)
        # where, not the tracer's own error text: torch.export runs instead, so it is not the user's to fix
        where = f"its submodule {symbolic_error.module!r}" if symbolic_error.module else "its forward"
        _warn_fixed_image_sizes(model, example_inputs, f"{where} does not trace symbolically", fixed)
        return _tagged(exported, "export")
    composite = _composite_leaves(traced) if example_inputs is not None else []
    if composite:
        try:  # their projections are only visible (and quantizable) in the exported graph
            exported, fixed = _raised_export(model, example_inputs, dynamic_shapes)
        except TraceError as error:
            _warn_float_composites(model, composite, error)
        else:
            _warn_fixed_image_sizes(model, example_inputs, f"it holds {_listed(composite)}, whose projections "
                                                           "only an exported graph shows", fixed)
            return _tagged(exported, "export")
    return _tagged(traced, "symbolic")


def _listed(modules: list[tuple[str, str]], most: int = 3) -> str:
    """``nn.TransformerEncoderLayer 'enc.layers.0', ...`` for (name, type name) pairs."""
    shown = ", ".join(f"{kind} {name!r}" for name, kind in modules[:most])
    return shown + (f" and {len(modules) - most} more" if len(modules) > most else "")


def _short(error: Exception) -> str:
    """An error's first line, cut where torch's long advice would follow."""
    return first_line(error)[:300]


def _warn_none_inputs(model: nn.Module, nones: list[str], export_error: TraceError | None) -> None:
    """Say which capture a None example input led to: symbolic tracing would take it for a tensor."""
    inputs = ", ".join(nones)
    why = (f"example input {inputs} of {type(model).__name__} is None, which symbolic tracing would take for a "
           "tensor (tracing `if ... is not None` branches the way the model does not run)")
    if export_error is None:
        warn_user(f"qplug: the {why}, so capture='auto' used torch.export (report.capture is 'export'). Pass "
                  "capture='export' to choose it, or leave the argument out of example_inputs so that "
                  "symbolic tracing takes its default as a constant")
    else:
        warn_user(f"qplug: the {why}, but torch.export could not capture the model ({_short(export_error)}), so "
                  "capture='auto' traced it symbolically all the same. Leave the argument out of "
                  "example_inputs so that symbolic tracing takes its default as a constant, or pass "
                  "capture='symbolic' to choose this")


def _warn_float_composites(model: nn.Module, composite: list[tuple[str, str]], export_error: TraceError) -> None:
    """Say that attention / transformer modules stay float: only the exported graph shows their
    projections, and torch.export failed."""
    warn_user(f"qplug: {type(model).__name__} holds {_listed(composite)}, whose linear projections only a "
              f"torch.export capture can quantize, but torch.export could not capture it ({_short(export_error)}); "
              "capture='auto' traced it symbolically and these modules stay float. Pass capture='symbolic' to "
              "choose this, or capture='export' to see the export fail")


def _warn_fixed_image_sizes(model: nn.Module, example_inputs: tuple[Any, ...], why: str,
                            fixed: str | None) -> None:
    """Say at quantize time what an export capture fixed: a detector quantized at 256x256 refused
    its first request of another size, with nothing said before. ``why``: why auto exported;
    ``fixed``: why the images' height and width stay the example's (None: they do not)."""
    images = [f"{name} {value.shape[2]}x{value.shape[3]}" for name, value in _named(model, example_inputs)
              if is_image(value)]
    if images and fixed is not None:
        way = ("calibrate with each size to serve; a ViT-style position table that does not interpolate "
               "fixes it: quantize once per size" if _position_table(model) else
               "calibrate with each size to serve, or pass dynamic_shapes=")
        warn_user(f"qplug: {type(model).__name__}: {why}, so capture='auto' used torch.export, fixing image "
                  f"sizes ({fixed}): it takes {', '.join(images)} only. Other sizes: {way} (docs/guide/export.md)")


def _position_table(model: nn.Module) -> bool:
    """Whether ``model`` holds a learned position table (ViT, YOLOS, DPT): unless the model
    interpolates it to the call's patch grid (YOLOS does, ViT at its own size does not), it fixes
    the grid and no dynamic height and width can take another size."""
    return any(name.endswith(("position_embeddings", "pos_embed", "pos_embedding"))
               for name, _ in model.named_parameters())


def _named(model: nn.Module, values: tuple[Any, ...]) -> list[tuple[str, Any]]:
    """``values`` with the forward parameter each one is given as (``input 2`` past the signature)."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        names = []
    return [(repr(names[i]) if i < len(names) else f"input {i}", value) for i, value in enumerate(values)]


def _symbolic(model: nn.Module, trace: dict[str, Any]) -> GraphModule:
    """Symbolic tracing; the parameters taken as constants are dropped from the signature, so a
    call passing another value raises (fx's own check is dead code to the passes after)."""
    try:
        gm = capture_module(model, **trace)
    except TraceError as error:  # fx's own failure inside: "... 'NoneType' object has no attribute 'pop'"
        if error.module is None and _decorated_varargs(type(model).forward):
            raise TraceError(f"cannot trace {type(model).__name__} symbolically: a decorator wraps its forward, "
                             "which takes *args or **kwargs, and torch.fx cannot trace that pair; "
                             "capture='export' takes it") from error
        raise
    constants = len(trace["concrete_args"] or {})
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    dropped = [n for n in placeholders[len(placeholders) - constants:] if constants
               and all(user.op == "call_function" and user.target in _FX_CHECKS for user in n.users)]
    for node in dropped:
        for check in list(node.users):
            gm.graph.erase_node(check)
        gm.graph.erase_node(node)
    if dropped and trace["generate_code"]:
        gm.recompile()
    return gm


#: what fx puts after a parameter traced as a constant (removed as dead code by the passes after)
_FX_CHECKS = (torch.fx._symbolic_trace._assert_is_none, torch._assert)


def defaults_not_given(model: nn.Module, example_inputs: tuple[Any, ...] | None) -> dict[str, Any] | None:
    """The defaults of the ``forward`` parameters the example inputs leave out, for symbolic tracing
    to take as constants: traced as inputs, ``if scale is not None`` took the branch the model never
    takes when called like its example (and the error blamed the example inputs)."""
    if example_inputs is None:
        return None
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature: trace it as it is
        return None
    given = len(example_inputs)
    defaults = {p.name: p.default for p in parameters[given:]
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty}
    return defaults or None


def _decorated_varargs(forward: Any) -> bool:
    """Whether ``forward`` is a decorator's wrapper (Hugging Face's call options) around a function
    taking *args or **kwargs: fx reads the inner function's parameters but runs the wrapper, and
    fails inside with whatever error the wrapper's code then meets."""
    inner = inspect.unwrap(forward)
    code = getattr(inner, "__code__", None)
    return inner is not forward and code is not None and bool(code.co_flags & _VARARGS)


_VARARGS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS


#: torch.nn modules that symbolic tracing keeps as leaves although they hold linear projections
_COMPOSITE_LEAVES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
                     nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer)


def _composite_leaves(gm: GraphModule) -> list[tuple[str, str]]:
    """(name, type name) of each composite leaf the traced graph calls."""
    modules = dict(gm.named_modules(remove_duplicate=False))
    return [(str(node.target), type(modules[node.target]).__name__) for node in gm.graph.nodes
            if node.op == "call_module" and isinstance(modules[node.target], _COMPOSITE_LEAVES)]


def _tagged(gm: GraphModule, level: str) -> GraphModule:
    gm.meta.setdefault(CAPTURE, level)
    gm.meta.setdefault(CAPTURE_SKIPPED, [])
    return gm


def _require_inputs(example_inputs: tuple[Any, ...] | None, level: str) -> tuple[Any, ...]:
    if example_inputs is None:
        raise ConfigValidationError(f"capture={level!r} runs torch.export, which needs "
                                    "example_inputs (a tuple of positional inputs)",
                                    field="example_inputs")
    return example_inputs


def _raised_export(model: nn.Module, example_inputs: tuple[Any, ...],
                   dynamic_shapes: Any = None) -> tuple[GraphModule, str | None]:
    """The exported graph, raised, and why its images' height and width stay the example's (None
    when they do not, or there are none): the user's ``dynamic_shapes`` are taken as given; without
    them the sizes are dynamic if the calibration data holds several and the graph answers each."""
    seen = sizes_seen()
    sizes = {image_sizes(inputs) for inputs in (example_inputs, *seen)} - {()}
    gm, fixed = None, ("one size calibrated" if seen else "one size given") if sizes else None
    with float_like_int8(model):  # a widened export is checked against the model's own answer
        if dynamic_shapes is not None:
            gm, fixed = export_with_shapes(model, example_inputs, dynamic_shapes), None
        elif len(sizes) > 1:
            try:
                gm, fixed = export_images_dynamic(model, example_inputs, seen), None
            except TraceError as error:
                fixed = f"the {len(sizes)} sizes calibrated could not stay dynamic: {error}"
        if gm is None:
            try:
                gm, not_widened = export_module(model, example_inputs)
            except Exception as e:
                raise TraceError(f"torch.export could not capture {type(model).__name__}: "
                                 f"{type(e).__name__}: {first_line(e)}") from e
            if not_widened is not None:
                _warn_fixed_ones(model, example_inputs, not_widened)
    return raise_aten_graph(gm).graph_module, fixed


def _warn_fixed_ones(model: nn.Module, example_inputs: tuple[Any, ...], not_widened: str) -> None:
    """Say at quantize time which sizes of 1 the export fixed because the graph exported at 2 was
    not kept (``not_widened``: why): a WavLM quantized from a batch-1 example refused its first
    batch of 3, with nothing said before."""
    ones = [f"dim {dim}{' (the batch)' if dim == 0 else ''} of input {name}"
            for name, value in _named(model, example_inputs) for dim in widened_ones(value)]
    warn_user(f"qplug: {type(model).__name__}: torch.export fixes {', '.join(ones)} at the example's size 1, so "
              f"the quantized model takes size 1 only there: {not_widened}. To serve other sizes, quantize "
              "with an example of the size you serve (a graph exported at 2 or more takes other sizes where "
              "the model's code does not read them as numbers), or pass dynamic_shapes= (docs/guide/export.md)")


def _check_dynamic_shapes(dynamic_shapes: Any, example_inputs: tuple[Any, ...] | None, model: Any,
                          level: str) -> None:
    """``dynamic_shapes`` in torch.export's form (one entry per example input, or a dict by name),
    for a module qplug exports: a graph or program given, or symbolic tracing asked for, exports nothing."""
    if dynamic_shapes is None:
        return
    if level == "symbolic" or isinstance(model, (torch.export.ExportedProgram, GraphModule)):
        given = "capture='symbolic'" if level == "symbolic" else f"a captured {type(model).__name__}"
        raise ConfigValidationError(f"dynamic_shapes is passed to torch.export, which {given} does not run; "
                                    "give an nn.Module with capture='auto' or 'export'", field="dynamic_shapes")
    count = None if example_inputs is None else len(example_inputs)
    if isinstance(dynamic_shapes, dict) or (isinstance(dynamic_shapes, (tuple, list))
                                            and len(dynamic_shapes) == count):
        return
    raise ConfigValidationError(
        f"dynamic_shapes must be what torch.export.export takes: a tuple with one entry per example input "
        f"({count}), each None or a dict {{dim: Dim}}, or a dict by forward parameter name; got "
        f"{type(dynamic_shapes).__name__}"
        + (f" of {len(dynamic_shapes)}" if isinstance(dynamic_shapes, (tuple, list)) else "")
        + ", e.g. dynamic_shapes=({2: 32 * Dim('h'), 3: 32 * Dim('w')},)", field="dynamic_shapes")


def _partly_opaque(model: nn.Module, trace: dict, symbolic_error: TraceError,
                   export_error: TraceError) -> GraphModule:
    """Symbolic capture with each submodule that stops tracing kept opaque (float), recorded."""
    names = list(trace["non_traceable_module_names"])
    skipped: list[tuple[str, str, str]] = []
    error = symbolic_error
    while error.module and len(skipped) < _MAX_OPAQUE_MODULES:
        module = model.get_submodule(error.module)
        module_type = type(module).__name__
        reason = f"capture failed: {both_failed(module, error.__cause__ or error, export_error)}"
        skipped.append((error.module, module_type, reason))
        names.append(error.module)
        try:
            gm = capture_module(model, **{**trace, "non_traceable_module_names": names})
        except TraceError as again:
            error = again
            continue
        gm.meta[CAPTURE] = "symbolic"
        gm.meta[CAPTURE_SKIPPED] = skipped
        opaque = [name for name, _, _ in skipped]
        warn_user(f"qplug: neither symbolic tracing nor torch.export captures {type(model).__name__} whole "
                  f"({_short(export_error)}), so capture='auto' keeps {_listed([(n, t) for n, t, _ in skipped])} float, "
                  "as opaque calls (report.skipped gives each reason). Pass capture='symbolic' with "
                  f"non_traceable_module_names={opaque!r} to choose this")
        return gm
    raise TraceError(f"neither torch.export nor symbolic tracing can capture "
                     f"{type(model).__name__}: {both_failed(model, error, export_error)}",
                     module=error.module) from export_error


def generates(model: Any) -> bool:
    """Whether ``model`` is a text-generating Hugging Face model (``generate()`` and a config)."""
    can_generate = getattr(model, "can_generate", None)
    return (isinstance(model, nn.Module) and callable(getattr(model, "generate", None))
            and getattr(model, "config", None) is not None and callable(can_generate) and bool(can_generate()))
