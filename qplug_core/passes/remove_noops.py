"""One-to-none rewrite, in place: drop ops that return their input unchanged at inference time.

Removed: ``detach`` (function, method and ``aten.detach``/``aten.alias``), ``nn.Identity``
modules, ``nn.Dropout*`` modules in eval mode, ``F.dropout`` / ``aten.dropout`` calls whose
``training`` argument is literally False, ``aten.to.dtype`` to the dtype the value already
has, and ``aten.slice.Tensor`` over a whole dimension (``x[:, :, -1]`` exports a ``[0:]`` slice of
dim 0 before the select). ``contiguous`` is kept: it changes memory layout, which kernels downstream may rely on.
The one rule set for both levels: the symbolic pipeline (:func:`remove_inference_noops`), the ATen raise
(``flows/raise_aten.py``) and :class:`RemoveNoOpsPass` all call :func:`remove_noops`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx import GraphModule

from qplug_core.passes.base import PassBase, PassResult

__all__ = ["DROPOUT_MODULES", "RemoveNoOpsPass", "remove_inference_noops", "remove_noops"]

aten = torch.ops.aten

_IDENTITY_FUNCTIONS = frozenset({torch.detach, torch.Tensor.detach, aten.detach.default, aten.alias.default})
_IDENTITY_METHODS = frozenset({"detach"})
_DROPOUT_FUNCTIONS = {
    # target -> (position, name) of its ``training`` argument
    F.dropout: (2, "training"), F.dropout1d: (2, "training"), F.dropout2d: (2, "training"),
    F.dropout3d: (2, "training"), F.alpha_dropout: (2, "training"),
    torch.dropout: (2, "train"), aten.dropout.default: (2, "train"),
}
DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                   nn.FeatureAlphaDropout)


def remove_noops(gm: GraphModule, *, keep_torch_calls: bool = False) -> bool:
    """Remove every no-op node of ``gm`` (its users read its input instead); whether any was.
    ``keep_torch_calls``: leave torch-level function and method calls (``x.detach()``,
    ``F.dropout(x, training=False)``): at the symbolic level they are patterns the backends
    match (sharing their input's qparams, as in torch.ao), so prepare keeps them; modules and
    ATen ops are removed either way."""
    changed = False
    modules = dict(gm.named_modules(remove_duplicate=False))  # one walk, not a lookup per node
    for node in list(gm.graph.nodes):
        if keep_torch_calls and node.op in ("call_function", "call_method") and not isinstance(
                node.target, torch._ops.OpOverload):
            continue
        source = _noop_input(modules, node)
        if source is not None:
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
            changed = True
    return changed


def _noop_input(modules: dict[str, nn.Module], node: fx.Node) -> fx.Node | None:
    """The input a no-op node returns unchanged, or None when ``node`` computes something."""
    if node.op == "call_module":
        module = modules[node.target]
        noop = isinstance(module, nn.Identity) or (isinstance(module, DROPOUT_MODULES) and not module.training)
    elif node.op == "call_method":
        noop = node.target in _IDENTITY_METHODS
    elif node.op == "call_function":
        noop = (node.target in _IDENTITY_FUNCTIONS
                or (node.target in _DROPOUT_FUNCTIONS and _training_is_false(node))
                or (node.target is aten.to.dtype and _same_dtype(node))
                or (node.target is aten.slice.Tensor and _whole_slice(node)))
    else:
        noop = False
    source = _first_input(node) if noop else None
    return source if isinstance(source, fx.Node) else None


def _first_input(node: fx.Node) -> Any:
    return node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))


def _training_is_false(node: fx.Node) -> bool:
    pos, name = _DROPOUT_FUNCTIONS[node.target]
    value = node.args[pos] if len(node.args) > pos else node.kwargs.get(name, True)
    return value is False


def _same_dtype(node: fx.Node) -> bool:
    """``aten.to.dtype(x, dtype)`` (nothing else asked for) where ``x`` already has that dtype."""
    if node.kwargs or len(node.args) != 2 or not isinstance(node.args[0], fx.Node):
        return False
    value = node.args[0].meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype == node.args[1]


def _whole_slice(node: fx.Node) -> bool:
    """``aten.slice.Tensor(x, dim, 0, <max>, 1)``: every element of ``x``, a view as ``aten.alias`` is."""
    start, end, step = (node.args[i] if len(node.args) > i else node.kwargs.get(name, default)
                        for i, name, default in ((2, "start", None), (3, "end", None), (4, "step", 1)))
    return start in (None, 0) and end in (None, sys.maxsize) and step == 1


class RemoveNoOpsPass(PassBase):
    """Remove detach, identity and eval-mode dropout nodes, in place; their users read the input."""

    def call(self, graph_module: GraphModule) -> PassResult:
        changed = remove_noops(graph_module)
        if changed:
            graph_module.graph.lint()
            graph_module.recompile()
        return PassResult(graph_module, changed)


def remove_inference_noops(gm: GraphModule) -> PassResult:
    """Remove eval-mode dropout and identity modules (a pass for the symbolic level, in place).

    They compute nothing at inference; left in the graph they would be reported as float ops.
    """
    changed = remove_noops(gm, keep_torch_calls=True)
    if changed:
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
    return PassResult(gm, changed)
