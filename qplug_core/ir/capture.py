"""Capture a model as a torch.fx GraphModule at two levels of the same IR.

* :func:`capture_module` traces symbolically (module-level graph: ``call_module`` for leaves,
  torch functions and methods otherwise). This is what the fuse/prepare/convert flows use.
* :func:`capture_aten` exports with ``torch.export`` and returns ``ExportedProgram.module()``:
  a runnable GraphModule whose ops are ``torch.ops.aten.*`` and whose parameters are ordinary
  attributes (``get_attr`` nodes), so the same passes run on both levels. ``graph_module`` of the
  ExportedProgram is not used because it lifts parameters to placeholders, which changes the
  calling convention.

A failure becomes a :class:`~qplug_core.errors.TraceError` that names the innermost submodule
whose ``forward`` could not be traced and the two ways out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Tracer

from qplug_core.errors import ConfigValidationError, TraceError

__all__ = ["CAPTURE_LEVELS", "QplugTracer", "capture_aten", "capture_for_quantization",
           "capture_module"]

#: the values of ``capture=`` every graph-mode flow accepts
CAPTURE_LEVELS = ("auto", "symbolic", "export")
#: GraphModule.meta keys: the capture level used, and submodules left opaque because capture failed
CAPTURE_KEY = "qplug_capture"
CAPTURE_SKIPPED_KEY = "qplug_capture_skipped"
_MAX_OPAQUE_MODULES = 16


class QplugTracer(Tracer):
    """fx's default leaf rule plus caller-chosen opaque modules; records the failing submodule.

    ``node.meta["nn_module_stack"]`` is filled by fx's Tracer itself (an ordered dict
    ``{qualified_name: (qualified_name, module_type)}``) for every node created inside a module.
    """

    def __init__(self, *, leaf_modules: Iterable[type[nn.Module]] = (),
                 non_traceable_module_names: Iterable[str] = (),
                 non_traceable_module_classes: Iterable[type[nn.Module]] = ()) -> None:
        super().__init__()
        self._leaf_classes = tuple(leaf_modules) + tuple(non_traceable_module_classes)
        self._leaf_names = frozenset(non_traceable_module_names)
        self._stack: list[str] = []
        self.failing_module: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self._leaf_names or isinstance(m, self._leaf_classes):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        name = self.path_of_module(m)
        self._stack.append(name)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            # The innermost frame records first; outer frames must not overwrite it.
            if self.failing_module is None:
                self.failing_module = name
            raise
        finally:
            self._stack.pop()


def capture_module(model: nn.Module, *, leaf_modules: Sequence[type[nn.Module]] = (),
                   non_traceable_module_names: Sequence[str] = (),
                   non_traceable_module_classes: Sequence[type[nn.Module]] = (),
                   concrete_args: dict[str, Any] | None = None) -> GraphModule:
    """Symbolically trace ``model`` into a GraphModule.

    The listed modules (by class or qualified name) become opaque ``call_module`` nodes; fx's
    default leaves (``torch.nn`` modules) stay leaves. Raises :class:`TraceError` naming the
    submodule that cannot be traced.
    """
    tracer = QplugTracer(leaf_modules=leaf_modules,
                         non_traceable_module_names=non_traceable_module_names,
                         non_traceable_module_classes=non_traceable_module_classes)
    try:
        graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as e:
        where = tracer.failing_module or ""
        location = f"submodule {where!r} ({type(model.get_submodule(where)).__name__})" \
            if where else f"the top-level forward of {type(model).__name__}"
        fix = (f"mark it non-traceable with non_traceable_module_names=[{where!r}] "
               f"(or non_traceable_module_classes=[{type(model.get_submodule(where)).__name__}])"
               if where else "move the untraceable code into a submodule and mark that submodule "
               "non-traceable (non_traceable_module_names / non_traceable_module_classes)")
        raise TraceError(f"cannot trace {location}: {type(e).__name__}: {e}. Either {fix}, or "
                         "quantize in eager mode with qp.eager.", module=where or None) from e
    name = type(model).__name__
    return GraphModule(tracer.root, graph, name)


def _export(model: nn.Module, example_inputs: tuple[Any, ...]) -> GraphModule:
    """``torch.export`` (non-strict: the model's Python runs as written) -> runnable GraphModule.

    The batch dimension (dim 0 of every tensor input) is exported as dynamic where the model
    allows it (``Dim.AUTO``), so the quantized model takes other batch sizes than the example's;
    when that export fails, every shape is specialised to the example.
    """
    batch = torch.export.ShapesCollection()
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            batch[value] = {0: torch.export.Dim.AUTO}
    try:
        return torch.export.export(model, example_inputs, strict=False, dynamic_shapes=batch).module()
    except Exception:
        return torch.export.export(model, example_inputs, strict=False).module()


def capture_for_quantization(model: nn.Module, example_inputs: tuple[Any, ...] | None, *,
                             level: str = "auto", leaf_modules: Sequence[type[nn.Module]] = (),
                             non_traceable_module_names: Sequence[str] = (),
                             non_traceable_module_classes: Sequence[type[nn.Module]] = (),
                             ) -> GraphModule:
    """The GraphModule the flows quantize, at the pattern set's level whatever the capture.

    ``level="auto"`` traces symbolically when the whole model traces, else exports it with
    ``torch.export`` and raises the ATen graph (:mod:`qplug_core.fx.raise_aten`); when both fail,
    the submodules that stop symbolic tracing stay opaque and are listed in
    ``meta[CAPTURE_SKIPPED_KEY]`` (the report names them). An ``ExportedProgram`` or its
    ``.module()`` is accepted as is. ``meta[CAPTURE_KEY]`` says which level was used.
    """
    from qplug_core.fx.raise_aten import is_aten_graph, raise_aten_graph

    if level not in CAPTURE_LEVELS:
        raise ConfigValidationError(f"capture must be one of {CAPTURE_LEVELS}, got {level!r}",
                                    field="capture", value=level)
    if isinstance(model, torch.export.ExportedProgram):
        model = model.module()
    if is_aten_graph(model):
        return _tagged(raise_aten_graph(model).graph_module, "export")
    if isinstance(model, GraphModule):
        return _tagged(model, "symbolic")
    trace = {"leaf_modules": leaf_modules, "non_traceable_module_names": non_traceable_module_names,
             "non_traceable_module_classes": non_traceable_module_classes}
    if level == "symbolic":
        return _tagged(capture_module(model, **trace), "symbolic")
    if level == "export":
        return _tagged(_raised_export(model, _require_inputs(example_inputs, level)), "export")
    try:
        traced = capture_module(model, **trace)
    except TraceError as symbolic_error:
        if example_inputs is None:
            raise TraceError(f"{symbolic_error} Or pass example_inputs so that qplug can capture the "
                             "model with torch.export.", module=symbolic_error.module) from symbolic_error
        try:
            return _tagged(_raised_export(model, example_inputs), "export")
        except TraceError as export_error:
            return _partly_opaque(model, trace, symbolic_error, export_error)
    if example_inputs is not None and _has_composite_leaves(traced):
        try:  # their projections are only visible (and quantizable) in the exported graph
            return _tagged(_raised_export(model, example_inputs), "export")
        except TraceError:
            pass
    return _tagged(traced, "symbolic")


#: torch.nn modules that symbolic tracing keeps as leaves although they hold linear projections
_COMPOSITE_LEAVES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
                     nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer)


def _has_composite_leaves(gm: GraphModule) -> bool:
    return any(node.op == "call_module" and isinstance(gm.get_submodule(node.target), _COMPOSITE_LEAVES)
               for node in gm.graph.nodes)


def _tagged(gm: GraphModule, level: str) -> GraphModule:
    gm.meta.setdefault(CAPTURE_KEY, level)
    gm.meta.setdefault(CAPTURE_SKIPPED_KEY, [])
    return gm


def _require_inputs(example_inputs: tuple[Any, ...] | None, level: str) -> tuple[Any, ...]:
    if example_inputs is None:
        raise ConfigValidationError(f"capture={level!r} runs torch.export, which needs "
                                    "example_inputs (a tuple of positional inputs)",
                                    field="example_inputs")
    return example_inputs


def _raised_export(model: nn.Module, example_inputs: tuple[Any, ...]) -> GraphModule:
    from qplug_core.fx.raise_aten import raise_aten_graph

    try:
        gm = _export(model, example_inputs)
    except Exception as e:
        raise TraceError(f"torch.export could not capture {type(model).__name__}: "
                         f"{type(e).__name__}: {_first_line(e)}") from e
    return raise_aten_graph(gm, model).graph_module


def _partly_opaque(model: nn.Module, trace: dict, symbolic_error: TraceError,
                   export_error: TraceError) -> GraphModule:
    """Symbolic capture with each submodule that stops tracing kept opaque (float), recorded."""
    names = list(trace["non_traceable_module_names"])
    skipped: list[tuple[str, str, str]] = []
    error = symbolic_error
    while error.module and len(skipped) < _MAX_OPAQUE_MODULES:
        module_type = type(model.get_submodule(error.module)).__name__
        reason = (f"capture failed: symbolic tracing: {_first_line(error.__cause__ or error)}; "
                  f"{export_error}")
        skipped.append((error.module, module_type, reason))
        names.append(error.module)
        try:
            gm = capture_module(model, **{**trace, "non_traceable_module_names": names})
        except TraceError as again:
            error = again
            continue
        gm.meta[CAPTURE_KEY] = "symbolic"
        gm.meta[CAPTURE_SKIPPED_KEY] = skipped
        return gm
    raise TraceError(f"neither symbolic tracing nor torch.export can capture "
                     f"{type(model).__name__}: {error}; {export_error}",
                     module=error.module) from export_error


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


def capture_aten(model: nn.Module, example_inputs: tuple[Any, ...], *,
                 decompose: bool = False) -> GraphModule:
    """Export ``model`` with ``torch.export`` into an ATen-level GraphModule.

    Returns ``ExportedProgram.module()`` (parameters as ``get_attr``, same calling convention as
    the model). With ``decompose=True`` the program is first lowered to the core ATen opset via
    ``run_decompositions()``.
    """
    if not isinstance(example_inputs, tuple):
        raise TraceError(f"example_inputs must be a tuple of positional inputs, got "
                         f"{type(example_inputs).__name__}; wrap a single tensor as (x,).")
    try:
        program = torch.export.export(model, example_inputs)
        if decompose:
            program = program.run_decompositions()
        return program.module()
    except Exception as e:
        raise TraceError(f"torch.export could not capture {type(model).__name__}: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Mark "
                         "data-dependent code non-traceable and use capture_module, or quantize "
                         "in eager mode with qp.eager.") from e
