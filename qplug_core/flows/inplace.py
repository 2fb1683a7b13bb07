"""Make later readers of an in-place op's input read its result, so graph rewriting keeps it.

``x.mul_(2); return self.fc(x)`` traces to a ``mul_`` node nobody uses and an ``fc`` node reading
the placeholder ``x``: fx's dead-code elimination drops the ``mul_`` (a method call counts as
pure), and an observer or quantize step inserted on ``x`` would see it before the mutation anyway,
so the int8 model computed ``fc(x)`` instead of ``fc(2 * x)``. After this pass every node after the
in-place op that read its input reads its result instead, which is what the float model
effectively did. When the mutated value is a graph input, the op is also made out-of-place
(``x.mul(2)``), so that qplug running the example and calibration batches does not change the
caller's tensors; elsewhere the in-place spelling stays (backends may have patterns for it). An
in-place op whose input is not read again is left alone.

Recognised: in-place tensor methods (``mul_``, ``clamp_``, ...), ``torch.relu_``-style functions,
augmented assignment (``operator.iadd``...), functionals called with ``inplace=True`` and leaf
modules with ``inplace=True``. Not covered: mutation through a view (``x.view(-1).mul_(2)``
followed by a use of ``x``).
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from qplug_core.passes import PassResult

_AUGMENTED = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
              operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
              operator.imod: operator.mod, operator.ipow: operator.pow, operator.iand: operator.and_,
              operator.ior: operator.or_, operator.ixor: operator.xor,
              operator.ilshift: operator.lshift, operator.irshift: operator.rshift}


def _in_place_name(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_")


def _mutates_first_argument(modules: dict[str, nn.Module], node: fx.Node) -> bool:
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        return isinstance(node.target, str) and _in_place_name(node.target)
    if node.op == "call_function":
        return node.target in _AUGMENTED or (
            getattr(node.target, "__module__", None) in ("torch", "torch._C._VariableFunctions")
            and _in_place_name(getattr(node.target, "__name__", "")))
    if node.op == "call_module":
        return getattr(modules[str(node.target)], "inplace", False) is True
    return False


def _make_out_of_place(node: fx.Node) -> None:
    """Rewrite ``node`` so it does not mutate its input, where an out-of-place twin exists."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if node.kwargs.get("inplace") is True and node.op != "call_module":
        node.kwargs = {**node.kwargs, "inplace": False}
    elif node.op == "call_method" and hasattr(torch.Tensor, name[:-1]):
        node.target = name[:-1]
    elif node.op == "call_function" and node.target in _AUGMENTED:
        node.target = _AUGMENTED[node.target]
    elif node.op == "call_function" and hasattr(torch, name[:-1]):
        node.target = getattr(torch, name[:-1])


def functionalize_inplace(gm: fx.GraphModule) -> PassResult:
    """Rewire readers of values that an in-place op changed (see the module docstring)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    modules = dict(gm.named_modules(remove_duplicate=False))  # one walk, not a lookup per node
    modified = False
    for node in list(gm.graph.nodes):
        mutated = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if mutated is None or not _mutates_first_argument(modules, node):
            continue
        later = [user for user in mutated.users if user is not node and order[user] > order[node]]
        if not later:
            continue
        if mutated.op == "placeholder":
            _make_out_of_place(node)
        for user in later:
            user.replace_input_with(mutated, node)
        modified = True
    if modified:
        gm.recompile()
    return PassResult(gm, modified)
