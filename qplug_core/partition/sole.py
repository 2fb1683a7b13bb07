"""The batch-1 call path of a converted model that is one delegated partition.

When a model's graph is only its inputs, one compiled partition called with them and that
partition's outputs (the digits CNN and most CNNs on a delegating backend), a call spends, besides
the runtime, the GraphModule's generated code, its attribute lookup of the partition and the
partition's own ``nn.Module.__call__``: ~3 us (AMD EPYC Zen 4) beside ~15 us of ONNX Runtime for a
small CNN at batch 1, which is the difference to the runtime's own session called directly.
:func:`install` gives such a GraphModule an instance ``forward`` that calls the partition's
``forward`` directly. Wherever that could answer differently from the generated code (the graph
recompiled to other code, the partition replaced, forward or backward hooks registered on it or
globally) it runs the generated code instead. The GraphModule's own ``__call__`` and hooks are
untouched; copies (deep copy, pickling) drop the shortcut and run the generated code. Inputs passed
by name are bound to the placeholders as the generated ``forward(self, x, mask)`` binds them; a
call that does not fit them is an :class:`InputMismatchError` naming the inputs
(:mod:`qplug_core.ir.call_inputs`, which every converted model's own check uses too).
"""

from __future__ import annotations

import weakref

from torch import fx, nn
from torch.nn.modules import module as _module

from qplug_core.ir.call_inputs import bind_inputs

#: torch's global module hooks (dicts it mutates in place), each of which nn.Module.__call__ honours
_GLOBAL_FORWARD_HOOKS, _GLOBAL_FORWARD_PRE_HOOKS = _module._global_forward_hooks, _module._global_forward_pre_hooks
_GLOBAL_BACKWARD_HOOKS, _GLOBAL_BACKWARD_PRE_HOOKS = _module._global_backward_hooks, _module._global_backward_pre_hooks


def sole_call(gm: fx.GraphModule) -> str | None:
    """The submodule name when ``gm``'s graph is its placeholders, one ``call_module`` with them
    in order (no keyword arguments) and an output of exactly that call; otherwise None."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    rest = nodes[len(placeholders):]
    if (len(rest) != 2 or nodes[:len(placeholders)] != placeholders
            or any(p.args for p in placeholders)):  # a default value: the call may pass fewer
        return None
    call, output = rest
    if (call.op != "call_module" or call.kwargs or list(call.args) != placeholders
            or output.op != "output" or output.args != (call,)):
        return None
    return str(call.target)


class SolePartitionForward:
    """``gm``'s forward when it only calls submodule ``name`` (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, name: str):
        self._gm = weakref.ref(gm)  # no cycle: the GraphModule owns this object
        self._name = name
        self._module: nn.Module = gm.get_submodule(name)
        self._code = gm.code
        self._inputs = tuple(str(n.target) for n in gm.graph.nodes if n.op == "placeholder")
        self.__wrapped__ = type(gm).forward.__get__(gm)  # inspect.signature reads the generated one

    def __call__(self, *inputs, **named):
        # tests spelled out (no generators): ~1 us of a ~20 us call at batch 1
        if named or len(inputs) != len(self._inputs):
            inputs = bind_inputs(self._inputs, inputs, named)
        gm = self._gm()
        module = self._module
        if (gm._code == self._code and gm._modules.get(self._name) is module
                and not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                         or module._backward_pre_hooks or _GLOBAL_FORWARD_HOOKS or _GLOBAL_FORWARD_PRE_HOOKS
                         or _GLOBAL_BACKWARD_HOOKS or _GLOBAL_BACKWARD_PRE_HOOKS)):
            return module.forward(*inputs)
        return type(gm).forward(gm, *inputs)

    @property
    def __code__(self):
        """The generated forward's code, which torch.compile and torch.export read from
        ``gm.forward`` (a GraphModule's forward is a function to them)."""
        return self.__wrapped__.__code__

    def __reduce__(self):
        return (_dropped, ())  # a copy runs the generated code (its GraphModule builds it anew)


def _dropped() -> None:
    return None


def install(gm: fx.GraphModule) -> bool:
    """Give ``gm`` the direct forward when its graph only calls one submodule; True if it did
    (a previous one is removed either way: the graph may have changed)."""
    gm.__dict__.pop("forward", None)
    name = sole_call(gm)
    if name is None:
        return False
    gm.forward = SolePartitionForward(gm, name)  # type: ignore[method-assign]
    return True


__all__ = ["SolePartitionForward", "install", "sole_call"]
