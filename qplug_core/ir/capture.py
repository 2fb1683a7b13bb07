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

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx import GraphModule

from qplug_core.errors import TraceError, first_line, warn_user
from qplug_core.ir.deferred_code import graph_module_without_code
from qplug_core.ir.quiet import quiet_torch
from qplug_core.ir.thread_confined import ThreadConfinedTracer

__all__ = ["QplugTracer", "capture_aten", "capture_module", "drop_guard_call", "export_images_dynamic",
           "export_module", "export_with_shapes", "widened_ones"]



class QplugTracer(ThreadConfinedTracer):
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
        if self.foreign_thread():  # another thread's model, run while this one is traced
            return forward(*args, **kwargs)
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


def _drop_string_annotations(graph: fx.Graph) -> None:
    """Forget type annotations fx kept as strings (a model module with ``from __future__ import
    annotations``): fx's code then names a global that is the string ``"torch.Tensor"``, which
    pickling the GraphModule (``torch.save`` of an observed model) cannot import. They only
    decorate the generated code."""
    for node in graph.nodes:
        if isinstance(node.type, str):
            node.type = None


def capture_module(model: nn.Module, *, leaf_modules: Sequence[type[nn.Module]] = (),
                   non_traceable_module_names: Sequence[str] = (),
                   non_traceable_module_classes: Sequence[type[nn.Module]] = (),
                   concrete_args: dict[str, Any] | None = None,
                   generate_code: bool = True) -> GraphModule:
    """Symbolically trace ``model`` into a GraphModule.

    The listed modules (by class or qualified name) become opaque ``call_module`` nodes; fx's
    default leaves (``torch.nn`` modules) stay leaves. Raises :class:`TraceError` naming the
    submodule that cannot be traced. ``generate_code=False`` (a caller that rewrites the graph and
    recompiles) leaves ``forward`` to be generated at first use (:mod:`.deferred_code`).
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
    _drop_string_annotations(graph)
    name = type(model).__name__
    gm = GraphModule(tracer.root, graph, name) if generate_code else \
        graph_module_without_code(tracer.root, graph, name)
    _keep_modes(model, gm)
    return gm


def _keep_modes(model: nn.Module, gm: GraphModule) -> None:
    """Give every submodule of ``gm`` the train/eval mode of the module at its path in ``model``.

    For a submodule traced through (a ``Conv2d`` subclass such as Hugging Face EfficientNet's
    depthwise conv), GraphModule copies only the tensors the graph reads, into fresh holder
    modules, which start in training mode: the fusion of an all-eval model then refused to fold
    its BatchNorms ("needs eval-mode modules")."""
    originals = dict(model.named_modules(remove_duplicate=False))
    for path, module in gm.named_modules(remove_duplicate=False):
        original = originals.get(path)
        if original is not None and original is not module:
            module.training = original.training
    gm.training = model.training


def export_module(model: nn.Module, example_inputs: tuple[Any, ...]) -> tuple[GraphModule, str | None]:
    """``torch.export`` (non-strict: the model's Python runs as written) -> runnable GraphModule.

    Every dimension of every tensor input is exported as dynamic where the model allows it
    (``Dim.AUTO``: torch keeps static what the model fixes, a feature size a Linear reads, a conv's
    channels), so the quantized model takes other batch sizes, sequence lengths and audio lengths
    than the example's (a time axis fixed by the features while a padding mask left it free made a
    graph that failed in a ``view`` at any other length); an image's height and width stay the
    example's (``_SPATIAL_RANK``: they cost a vision transformer's capture 10-15x); when that export fails,
    every shape is specialised to the example. torch.export specialises a dimension of size 1
    (0/1 specialisation: a batch-1 example gave a model that refused batch 4), so the batch and
    the dimensions of integer inputs (token ids, masks) are exported from the example repeated to
    size 2 along them, and kept only where the exported graph answers the example itself as the
    model does, run without its guards on size relations as qplug's raised graph runs (a branch on
    ``batch > 1`` is then traced the other way: the example's own sizes are exported instead).
    When every shape is specialised, a warning says so and why. Returns the graph and why the
    widened export was not kept (None: it was, or none was tried), with which the caller names
    the sizes of 1 that stay fixed.
    """
    widened = tuple(_widened(value) for value in example_inputs)
    not_widened = None
    if any(a is not b for a, b in zip(widened, example_inputs)):
        try:
            exported = _export(model, widened, _auto(widened))
        except Exception as e:  # noqa: BLE001 - exported from the example's own sizes below
            not_widened = f"torch.export failed at size 2 ({type(e).__name__}: {first_line(e)[:200]})"
        else:
            drop_guard_call(exported)  # as raised: the relations it guards, qplug's graph does not check
            exported.recompile()
            not_widened = _disagreement(model, exported, example_inputs)
            if not_widened is None:
                return exported, None
            not_widened = f"the graph exported at size 2 {not_widened}"
    try:
        return _export(model, example_inputs, _auto(example_inputs)), not_widened
    except Exception as dynamic_failure:  # noqa: BLE001 - every shape specialised below, or both errors
        try:
            exported = _export(model, example_inputs, None)
        except Exception as static_failure:
            raise static_failure from dynamic_failure
        warn_user(f"qplug: torch.export could not keep the input sizes dynamic ({type(dynamic_failure).__name__}: "
                  f"{first_line(dynamic_failure)}); the captured model takes inputs of the example's shapes only")
        return exported, None


def drop_guard_call(gm: GraphModule) -> None:
    """Remove the ``_guards_fn`` call of an ``ExportedProgram.module()``: the relations between input
    sizes torch.export assumed while tracing. At batch 2, WavLM's guard ``batch * frames != frames``
    refused batch 1, which the graph computes as the model does."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            gm.graph.erase_node(node)


#: where torch.export logs a failure's notes (it prints the partial graph on stderr itself)
_EXPORT_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._export")


def _export(model: nn.Module, inputs: tuple[Any, ...], dynamic: Any) -> GraphModule:
    """Non-strict ``torch.export`` of ``model`` -> runnable module, quietly: a failure is handled
    by the caller (another export, symbolic tracing, or a TraceError naming it), and torch's dump
    of the partial graph on stderr was all the user saw of it.

    A model in eval mode (post-training quantization) is exported with gradients off: a
    ``torch.no_grad()`` block in its forward (Speech2Text's position embedding) then changes
    nothing and is traced inline, where export otherwise wraps it in a ``wrap_with_set_grad_enabled``
    submodule that no pattern matches, no backend compiles and ``qp.save`` cannot write. A model in
    training mode (QAT) keeps its blocks: gradients must not flow where its forward stops them."""
    grad_mode = torch.no_grad() if not model.training else contextlib.nullcontext()
    with quiet_torch(_EXPORT_LOGGERS, stderr=True), grad_mode:
        return torch.export.export(model, inputs, strict=False, dynamic_shapes=dynamic).module()


#: float inputs of this rank or more are images or video (N, C, H, W, ...): only their batch is
#: dynamic. Symbolic heights and widths made a SwinV2's export (window partitioning: shape
#: arithmetic on every block) take 10-15x longer to capture.
_SPATIAL_RANK = 4


def is_image(value: Any) -> bool:
    """A float input of rank 4 or more, whose sizes after the batch the export capture fixes."""
    return isinstance(value, torch.Tensor) and value.dim() >= _SPATIAL_RANK and (
        value.dtype.is_floating_point or value.is_complex())


def _auto(inputs: tuple[Any, ...], *, images: bool = False) -> torch.export.ShapesCollection:
    """Every dimension of every tensor input dynamic where the model allows it, but an image's
    (``images=True``: an image's too)."""
    dynamic = torch.export.ShapesCollection()
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.dim():
            fixed = is_image(value) and not images
            dynamic[value] = dict.fromkeys(range(1 if fixed else value.dim()), torch.export.Dim.AUTO)
    return dynamic


def export_images_dynamic(model: nn.Module, example_inputs: tuple[Any, ...],
                          seen: Sequence[tuple[Any, ...]]) -> GraphModule:
    """:func:`export_module` with the images' height and width dynamic too (``Dim.AUTO``), for
    inputs of several image sizes ``seen`` (calibration batches): kept only if the exported graph
    answers each of them as the model does, else :class:`TraceError` says why (the caller then
    exports with the example's sizes, which :func:`export_module` keeps for their capture cost).
    """
    widened = tuple(_widened(value) for value in example_inputs)
    try:
        exported = _export(model, widened, _auto(widened, images=True))
    except Exception as e:
        raise TraceError(f"{type(e).__name__}: {first_line(e)[:200]}") from e
    for inputs in seen:
        if _disagreement(model, exported, inputs) is not None:
            sizes = "x".join(str(n) for n in next(v for v in inputs if is_image(v)).shape[2:])
            raise TraceError(f"the graph exported with dynamic height and width does not answer a {sizes} "
                             "image as the model does")
    return exported


def export_with_shapes(model: nn.Module, example_inputs: tuple[Any, ...], dynamic_shapes: Any) -> GraphModule:
    """:func:`export_module` with the user's own ``dynamic_shapes`` (torch.export's format), as given."""
    try:
        return _export(model, example_inputs, dynamic_shapes)
    except Exception as e:
        raise TraceError(f"torch.export could not capture {type(model).__name__} with the dynamic_shapes "
                         f"given: {type(e).__name__}: {first_line(e)[:300]}") from e


def widened_ones(value: Any) -> tuple[int, ...]:
    """The dimensions of size 1 an example is widened along: the batch, and every one of an integer
    input (token ids and masks). Not a float input's others: a single channel or feature is the
    model's own size (a mono Conv1d), and widening it only costs a failed export."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return ()
    integer = not (value.dtype.is_floating_point or value.is_complex())
    return tuple(dim for dim in (range(value.dim()) if integer else (0,)) if value.shape[dim] == 1)


def _widened(value: Any) -> Any:
    """``value`` repeated to size 2 along its widened dimensions of size 1 (itself if none)."""
    for dim in widened_ones(value):
        value = torch.cat([value, value], dim=dim)
    return value


@torch.no_grad()
def _disagreement(model: nn.Module, exported: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
    """How ``exported`` fails to give the model's own outputs for ``example_inputs`` (None: it gives
    them): the error it raises (a guard of torch.export's refusing the sizes), or that they differ.

    Both run as they are, so a model in training mode updates its BatchNorm statistics and draws
    dropout masks: buffers and the random state are put back after, as capture never changes the
    user's model (prepare_qat_fx on a batch-1 example moved its running means twice)."""
    buffers = [b for m in (model, exported) for b in m.buffers()]
    kept = [b.clone() for b in buffers]
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            expected = pytree.tree_leaves(model(*example_inputs))
            torch.manual_seed(0)
            got = pytree.tree_leaves(exported(*example_inputs))
    except Exception as e:  # noqa: BLE001 - a graph that cannot take the example does not answer it
        return f"refuses the example's sizes ({type(e).__name__}: {first_line(e)[:200]})"
    finally:
        for buffer, value in zip(buffers, kept):
            buffer.copy_(value)
    alike = len(expected) == len(got) and all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-5) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        else a == b for a, b in zip(expected, got))
    return None if alike else "answers the example otherwise than the model (a branch on the size)"


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
