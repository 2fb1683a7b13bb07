"""A call of a converted model binds to the inputs it was quantized with, or says why not.

A GraphModule's generated ``forward(self, x, mask)`` met a misspelt or missing input with Python's
``TypeError: forward() got an unexpected keyword argument 'msk'``, while a model whose graph is one
delegated partition (:mod:`qplug_core.partition.sole`) answered with the inputs it takes and a "did
you mean". :func:`check_call` is that answer for every converted model: :func:`guard_input_names`
puts it in a forward pre-hook that costs one comparison for a call giving every input by position
and one set comparison for a call naming them, and spells the error out only when the call does
not fit the generated forward's signature.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from torch import fx, nn

from qplug_core.errors import InputMismatchError
from qplug_core.ir.hooks import drop_pre_hooks

__all__ = ["argument_positions", "bind_inputs", "check_call", "guard_input_names"]


def check_call(names: tuple[str, ...], positional: tuple, named: dict[str, Any], required: int) -> None:
    """Raise :class:`InputMismatchError` unless a call giving ``positional`` then ``named`` binds to
    inputs ``names``, the first ``required`` of which have no default."""
    takes = f"it takes the inputs ({', '.join(names)}) it was quantized with, by position or by name"
    left_out = "(an argument left out of example_inputs is not one of them)"
    if len(positional) > len(names):
        raise InputMismatchError(f"the int8 model was called with {len(positional)} positional inputs; "
                                 f"{takes} {left_out}")
    unknown = [key for key in named if key not in names]
    if unknown:
        near = {key: difflib.get_close_matches(key, names, n=1) for key in unknown}
        hints = "".join(f" (did you mean {near[key][0]!r} for {key!r}?)" for key in unknown if near[key])
        raise InputMismatchError(f"the int8 model has no input named {', '.join(map(repr, unknown))}{hints}; "
                                 f"{takes} {left_out}")
    twice = [key for key in names[:len(positional)] if key in named]
    missing = [key for key in names[len(positional):required] if key not in named]
    if twice or missing:
        problem = (f"input(s) {', '.join(map(repr, twice))} given both by position and by name" if twice
                   else f"input(s) {', '.join(map(repr, missing))} missing")
        raise InputMismatchError(f"the int8 model was called with {problem}; {takes}")


def bind_inputs(names: tuple[str, ...], positional: tuple, named: dict[str, Any]) -> tuple:
    """The inputs ``names`` (none with a default) in order, from a call that gives some by position
    and the rest by name."""
    check_call(names, positional, named, len(names))
    return (*positional, *(named[key] for key in names[len(positional):]))


def argument_positions(gm: fx.GraphModule) -> list[int | None]:
    """Per placeholder of ``gm``, the position of the ``forward()`` argument it is. A graph that
    keeps export's pytree calling code (a dict or list input) has a placeholder per tensor inside
    such an argument: those have none (a check finds them by name only, when passed by keyword, as
    a keyword input is). Every per-input check asks here, so that none reads another argument's
    tensor for a dict input's."""
    count = sum(node.op == "placeholder" for node in gm.graph.nodes)
    if type(gm.graph._codegen) is fx.graph.CodeGen:  # one placeholder per forward() argument
        return list(range(count))
    positions: list[int | None] = [None] * count
    spec = getattr(gm, "_in_spec", None)  # export's
    if spec is None:
        return positions
    leaf = 0
    for position, argument in enumerate(spec.child(0).children()):  # export's spec: (args, kwargs)
        if argument.is_leaf() and leaf < count:
            positions[leaf] = position
        leaf += argument.num_leaves
    return positions


def guard_input_names(gm: fx.GraphModule) -> None:
    """Refuse, with :func:`check_call`'s error, a call of ``gm`` its generated forward cannot bind."""
    drop_pre_hooks(gm, lambda hook: isinstance(hook, _InputNames))  # a copy's graph may take others
    parameters = list(inspect.signature(type(gm).forward).parameters.values())[1:]  # after self
    if all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters):  # else it binds what it is given
        names = tuple(p.name for p in parameters)
        required = sum(p.default is p.empty for p in parameters)
        gm.register_forward_pre_hook(_InputNames(names, required), with_kwargs=True)


class _InputNames:
    """Forward pre-hook: the call binds to ``names``; ``tails[i]`` is the set of names a call giving
    ``i`` inputs by position gives by name when it gives all of them."""

    def __init__(self, names: tuple[str, ...], required: int) -> None:
        self.names, self.required = names, required
        self.tails = [frozenset(names[count:]) for count in range(len(names) + 1)]

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if kwargs:
            if len(args) < len(self.tails) and kwargs.keys() == self.tails[len(args)]:
                return
        elif len(args) == len(self.names):
            return
        check_call(self.names, args, kwargs, self.required)
