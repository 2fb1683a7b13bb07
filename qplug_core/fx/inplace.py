"""Make in-place tensor ops out-of-place, so that rewriting the graph keeps what they compute.

``x.mul_(2); return self.fc(x)`` traces to a ``mul_`` node nobody uses and an ``fc`` node reading
the placeholder ``x``: fx's dead-code elimination drops the ``mul_`` (a method call counts as
pure), and an observer inserted on ``x`` would see it before the mutation anyway, so the int8
model computed ``fc(x)`` instead of ``fc(2 * x)``. After this pass the op is ``x.mul(2)`` and the
later uses of ``x`` read its result, as the float model effectively did.

Covered: in-place tensor methods (``mul_``, ``add_``, ``clamp_``, ...), ``torch.relu_``-style
functions, ``operator.iadd``-style augmented assignments, functionals called with
``inplace=True`` and leaf modules with ``inplace=True`` (``nn.ReLU(inplace=True)``). Not covered:
mutation through a view (``x.view(-1).mul_(2)`` followed by a use of ``x``). The int8 model does
not mutate its caller's input tensors.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from qplug_core.passes import PassResult

_AUGMENTED = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
              operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
              operator.imod: operator.mod, operator.ipow: operator.pow, operator.iand: operator.and_,
              operator.ior: operator.or_, operator.ixor: operator.xor,
              operator.ilshift: operator.lshift, operator.irshift: operator.rshift}


def _out_of_place_method(name: object) -> str | None:
    if not isinstance(name, str) or not name.endswith("_") or name.startswith("_"):
        return None
    return name[:-1] if hasattr(torch.Tensor, name[:-1]) else None


def _out_of_place_function(target: object) -> object | None:
    if target in _AUGMENTED:
        return _AUGMENTED[target]
    name = getattr(target, "__name__", "")
    if getattr(target, "__module__", None) in ("torch", "torch._C._VariableFunctions") \
            and name.endswith("_") and not name.startswith("_"):
        return getattr(torch, name[:-1], None)
    return None


def _make_out_of_place(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Rewrite ``node`` to not mutate its first argument; whether it did mutate it."""
    if node.op == "call_method" and (method := _out_of_place_method(node.target)):
        node.target = method
        return True
    if node.op == "call_function" and (function := _out_of_place_function(node.target)) is not None:
        node.target = function
        return True
    if node.op in ("call_function", "call_method") and node.kwargs.get("inplace") is True:
        node.kwargs = {**node.kwargs, "inplace": False}
        return True
    if node.op == "call_module" and getattr(gm.get_submodule(node.target), "inplace", False) is True:
        gm.get_submodule(node.target).inplace = False  # the flows work on their own copy
        return True
    return False


def functionalize_inplace(gm: fx.GraphModule) -> PassResult:
    """Turn in-place ops into out-of-place ones; later readers of the mutated value read the result."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    modified = False
    for node in list(gm.graph.nodes):
        mutated = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if mutated is None or not _make_out_of_place(gm, node):
            continue
        modified = True
        for user in list(mutated.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(mutated, node)
    if modified:
        gm.recompile()
    return PassResult(gm, modified)
