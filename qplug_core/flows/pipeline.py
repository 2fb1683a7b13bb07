"""The steps every flow starts with: inputs as a tuple, capture, fuse, and running passes.

They live below the flows (``qplug_core.flows.steps``) so that other consumers of the same decisions
(``analysis.by_backend``, ``qp.load``) reuse them without importing the flows.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch import fx, nn

from qplug_core.enums import Stage
from qplug_core.errors import ConfigValidationError, InputMismatchError
from qplug_core.flows.annotation_guard import guard_plugin_pass
from qplug_core.flows.capture import capture_for_quantization
from qplug_core.flows.fuse import fuse_graph
from qplug_core.flows.inplace import functionalize_inplace
from qplug_core.flows.leaves import leaf_module_classes
from qplug_core.flows.normalize import normalize_functionals
from qplug_core.flows.raise_aten import exported_module
from qplug_core.flows.shared_modules import untie_shared_modules
from qplug_core.flows.tags import FUSIONS
from qplug_core.ir.copying import deepcopy_graph
from qplug_core.nn.computed_weights import without_computed_weights
from qplug_core.nn.copying import detach_from
from qplug_core.passes import PassManager
from qplug_core.passes.remove_noops import remove_inference_noops

if TYPE_CHECKING:
    from qplug_core.registry.backends import Backend


def as_input_tuple(example_inputs: Any, model: Any = None) -> tuple:
    """``example_inputs`` as a tuple of positional inputs (a bare tensor counts as a 1-tuple).

    A dict of keyword inputs (a tokenizer's ``BatchEncoding``) is refused: graphs and comparisons
    call the model with positional inputs, and the dict would arrive as its first argument. The error
    reads ``model``'s forward() to say how to pass it."""
    if hasattr(example_inputs, "keys"):
        keys = [str(key) for key in example_inputs.keys()]
        raise InputMismatchError(
            f"got a dict of keyword inputs ({', '.join(keys)}), but a graph or a comparison calls the "
            f"model with positional inputs: {_dict_advice(keys, model)}, for the example and for every "
            "batch (qp.quantize_w8a8 and qp.quantize_weights, which call the model itself, take dicts)")
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def bound_to_forward(inputs: Any, model: Any) -> Any:
    """A dict of keyword inputs whose keys are ``model.forward``'s positional parameters, as the
    tuple forward takes (the parameters between them at their defaults: Whisper's
    ``{"input_features", "decoder_input_ids"}`` is ``(features, None, ids)``), so that ``qp.quantize``
    takes the batches of its W8A8 route on its graph route too, also wrapped in a 1-tuple as
    ``example_inputs`` often are; anything else unchanged (a dict that does not bind is refused
    later by :func:`as_input_tuple`, with advice)."""
    if isinstance(inputs, (tuple, list)) and len(inputs) == 1 and hasattr(inputs[0], "keys"):
        bound = bound_to_forward(inputs[0], model)
        return inputs if bound is inputs[0] else bound
    params = _positional_parameters(model) if hasattr(inputs, "keys") and len(inputs) else None
    if params is None or not set(inputs.keys()) <= set(params):
        return inputs
    defaults = inspect.signature(model.forward).parameters
    values = []
    for name in params[:max(params.index(key) for key in inputs.keys()) + 1]:
        if name not in inputs and defaults[name].default is inspect.Parameter.empty:
            return inputs
        values.append(inputs[name] if name in inputs else defaults[name].default)
    return tuple(values)


def bound_batches(data: Any, model: Any) -> Any:
    """:func:`bound_to_forward` on each batch of a list or an iterator (read once either way), and
    of a re-iterable loader (a DataLoader) each time it is read, as a re-iterable view of it; a
    tensor (one batch), a dict and what is not iterable unchanged (read or refused as given)."""
    if isinstance(data, (list, tuple)):
        return [bound_to_forward(batch, model) for batch in data]
    if isinstance(data, Iterator):
        return (bound_to_forward(batch, model) for batch in data)
    if isinstance(data, (torch.Tensor, str, bytes)) or hasattr(data, "keys") or not isinstance(data, Iterable):
        return data
    return (_SizedBoundBatches if hasattr(data, "__len__") else _BoundBatches)(data, model)


class _BoundBatches:
    """A loader's batches bound to ``model``'s forward as they are read, each time it is read: a
    DataLoader loads lazily, and a list of it would hold every batch at once."""

    def __init__(self, data: Iterable[Any], model: Any) -> None:
        self.data, self.model = data, model

    def __iter__(self) -> Iterator[Any]:
        return (bound_to_forward(batch, self.model) for batch in self.data)


class _SizedBoundBatches(_BoundBatches):
    """:class:`_BoundBatches` of a loader with a length (a progress bar's total)."""

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]


def _dict_advice(keys: list[str], model: Any) -> str:
    """How to pass a dict ``batch`` to this forward(): its values in forward()'s order when they are
    its arguments, the dict wrapped whole when forward() takes one argument, else either one."""
    params = _positional_parameters(model)
    if params is not None and set(keys) == set(params[:len(keys)]):
        values = ", ".join(f"batch[{name!r}]" for name in params[:len(keys)])
        more = ", ..." if len(params) > len(keys) else ""
        return (f"pass ({values}{',' if len(keys) == 1 else ''}), the dict's values in the order of "
                f"{type(model).__name__}.forward({', '.join(params[:len(keys)])}{more})")
    if params is not None and len(params) == 1:
        return f"{type(model).__name__}.forward({params[0]}) takes the dict as its one argument: wrap it in a " \
               "tuple, (batch,)"
    return ("wrap it in a tuple, (batch,), if forward() takes the dict as one argument, else pass its values "
            "as a tuple in the order of forward()'s arguments")


def _positional_parameters(model: Any) -> list[str] | None:
    """The names of ``model.forward``'s positional parameters; None where they cannot be read."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return None
    return [p.name for p in parameters
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]


def plugin_passes(backend: Backend, stage: str) -> list[Callable]:
    """The backend's plugin passes for ``stage``, each guarded so that it may add its own node
    annotations but not rewrite qplug's or another plugin's (annotation_guard)."""
    return [guard_plugin_pass(pass_, label) for label, pass_ in backend.passes(stage)]


def run_passes(gm: fx.GraphModule, passes: list, *, recompile: bool = True) -> None:
    """Run flow passes in place through the PassManager (lint after each pass under QPLUG_DEBUG);
    ``recompile=False`` when the graph goes straight into another run that recompiles."""
    debug = os.environ.get("QPLUG_DEBUG") == "1"
    with gc_paused():
        PassManager(passes, inplace=True, run_checks_after_each_pass=debug,
                    recompile=recompile)(gm)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
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


def capture_graph(model: nn.Module, example_inputs: tuple | None = None, *, inplace: bool,
            capture: str = "auto", is_qat: bool = False, non_traceable_module_names=(),
            non_traceable_module_classes=(), dynamic_shapes: Any = None) -> fx.GraphModule:
    """The model as a GraphModule at the level ``capture`` asks for (see ``capture_for_quantization``);
    an ``ExportedProgram`` is taken through a fresh ``.module()``, never modified. Computed weights
    (weight_norm, parametrizations) are baked into plain ones on qplug's copy, or kept trainable
    for QAT (nn/computed_weights.py), before capture, so that every flow quantizes them alike."""
    if isinstance(model, torch.export.ExportedProgram):
        model = exported_module(model)
        inplace = True
    if not isinstance(model, nn.Module):
        raise ConfigValidationError(f"model must be a torch.nn.Module or an ExportedProgram, got "
                                    f"{type(model).__name__}", field="model", value=type(model).__name__)
    model, inplace = without_computed_weights(model, inplace=inplace, trainable=is_qat)
    options = {"level": capture, "leaf_modules": leaf_module_classes(),
               "non_traceable_module_names": non_traceable_module_names,
               "non_traceable_module_classes": non_traceable_module_classes,
               "generate_code": False, "dynamic_shapes": dynamic_shapes}  # fuse_model's passes rewrite the graph, then recompile
    # captured in float32 whatever autocast the caller has on: torch.export records autocast's casts
    with gc_paused(), torch.autocast("cpu", enabled=False):
        if inplace or isinstance(model, fx.GraphModule):  # a graph is returned as is: copy it whole
            return capture_for_quantization(model if inplace else deepcopy_graph(model),
                                            example_inputs, **options)
        # capture only reads the model; then copy what the graph shares with it (nn/copying.py)
        gm = capture_for_quantization(model, example_inputs, **options)
        detach_from(model, gm)
        return gm


def fuse_model(model: nn.Module, chosen: Backend, example_inputs: tuple | None = None, *,
               is_qat: bool = False, inplace: bool = False, capture: str = "auto",
               non_traceable_module_names=(), non_traceable_module_classes=(),
               recompile: bool = True, dynamic_shapes: Any = None) -> fx.GraphModule:
    """Capture ``model`` and fuse it with ``chosen``'s fusion patterns (the body of ``fuse_fx``).

    ``recompile=False`` (prepare, whose own passes recompile once at the end) leaves
    ``forward`` as traced: the caller must recompile before running the module."""
    gm = capture_graph(model, example_inputs, inplace=inplace, capture=capture, is_qat=is_qat,
                       non_traceable_module_names=non_traceable_module_names,
                       non_traceable_module_classes=non_traceable_module_classes,
                       dynamic_shapes=dynamic_shapes)

    def fuse(graph_module: fx.GraphModule) -> None:
        # a graph fused before (qp.quantize's SmoothQuant prepares the fused graph again) keeps its
        # records: qp.compare reads them to pair each fused layer with the float ops it computes
        graph_module.meta[FUSIONS] = [*graph_module.meta.get(FUSIONS, []),
                                      *fuse_graph(graph_module, chosen, is_qat=is_qat)]

    run_passes(gm, [remove_inference_noops, untie_shared_modules, functionalize_inplace,
                    *plugin_passes(chosen, Stage.PRE_FUSE), normalize_functionals, fuse],
               recompile=recompile)
    return gm


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode for a run that must not change the model (no BN statistic updates, no dropout),
    then every module's own flag back (compare, and the annotating run of prepare)."""
    modes = [(m, m.training) for m in model.modules() if m.training]  # only these change
    if modes:
        model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
