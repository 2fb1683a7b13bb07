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
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from qplug_core.errors import InputMismatchError
from qplug_core.ir.fixed_values import fixed_refusal, same_value
from qplug_core.ir.hooks import drop_pre_hooks, keep_in_copies

__all__ = ["MISSING", "InputPath", "bind_inputs", "check_call", "guard_input_names", "input_paths"]


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


MISSING = object()


@dataclass(frozen=True)
class InputPath:
    """Where one placeholder's value is in a call: ``forward()`` argument ``position`` (or the
    keyword ``argument``), then ``keys`` into the dict, list or tuple it sits in."""

    position: int | None
    argument: str
    keys: tuple[Any, ...] = ()

    @property
    def label(self) -> str:
        """How the user names it: ``x``, ``inputs['p']``, ``pair[1]``."""
        return self.argument + "".join(f"[{key!r}]" for key in self.keys)

    def value(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The value a call gives here, :data:`MISSING` if the argument is not given at all (that
        is :func:`guard_input_names`'s to say); a dict or list without it is refused by name."""
        if self.position is not None and self.position < len(args):
            value = args[self.position]
        else:
            value = kwargs.get(self.argument, MISSING)
        for depth, key in enumerate(self.keys):
            if value is MISSING:
                return MISSING
            try:
                value = value[key]
            except (KeyError, IndexError, TypeError):
                raise InputMismatchError(self._not_found(depth, value)) from None
        return value

    def _not_found(self, depth: int, container: Any) -> str:
        holder = InputPath(self.position, self.argument, self.keys[:depth]).label
        key = self.keys[depth]
        given = (f"a {type(container).__name__} with keys {sorted(map(str, container))}" if isinstance(container, dict)
                 else f"a {type(container).__name__} of {len(container)}" if isinstance(container, (list, tuple))
                 else f"a {type(container).__name__}")
        return (f"input {holder!r} is {given}, without {key!r}: the model was captured (torch.export) with "
                f"{self.label} in it, and its graph takes that structure only. Pass {holder} as in the example")


def input_paths(gm: fx.GraphModule) -> list[InputPath | None]:
    """Per placeholder of ``gm``, where a call gives its value (None: nowhere a check can read).
    A graph that keeps export's pytree calling code (a dict or list input) has a placeholder per
    tensor inside such an argument; its paths come from export's input spec. Every per-input check
    asks here, so that none reads another argument's tensor for a dict input's."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    spec = getattr(gm, "_in_spec", None)  # export's: ((args...), {kwargs})
    if type(gm.graph._codegen) is fx.graph.CodeGen or spec is None:  # one placeholder per argument
        return [InputPath(index, str(node.target)) for index, node in enumerate(placeholders)]
    names = list(inspect.signature(type(gm).forward).parameters)[1:]  # after self
    paths: list[InputPath | None] = []
    for position, argument in enumerate(spec.child(0).children()):
        name = names[position] if position < len(names) else f"input {position}"
        _leaf_paths(argument, InputPath(position, name), paths)
    keywords = spec.child(1)
    for key, argument in zip(keywords.context or (), keywords.children()):
        _leaf_paths(argument, InputPath(None, str(key)), paths)
    return paths if len(paths) == len(placeholders) else [None] * len(placeholders)


def _leaf_paths(spec: Any, path: InputPath, paths: list[InputPath | None]) -> None:
    """The paths of ``spec``'s leaves under ``path``: into dicts by key, lists and tuples by index;
    a leaf inside another container type (a dataclass, a model output) gets None."""
    if spec.is_leaf():
        paths.append(path)
        return
    if spec.type in (dict, OrderedDict):
        keys: Iterable[Any] = spec.context
    elif issubclass(spec.type, (list, tuple)):
        keys = range(spec.num_children)
    else:
        paths.extend([None] * spec.num_leaves)
        return
    for key, child in zip(keys, spec.children()):
        _leaf_paths(child, InputPath(path.position, path.argument, (*path.keys, key)), paths)


def guard_input_names(gm: fx.GraphModule, fixed: dict[str, list[Any]]) -> None:
    """Refuse, with :func:`check_call`'s error, a call of ``gm`` its generated forward cannot bind;
    a keyword the capture ``fixed`` (keyword -> the values it stands for) is dropped when given one
    of them."""
    drop_pre_hooks(gm, lambda hook: isinstance(hook, _InputNames))  # a copy's graph may take others
    parameters = list(inspect.signature(type(gm).forward).parameters.values())[1:]  # after self
    if all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters):  # else it binds what it is given
        names = tuple(p.name for p in parameters)
        required = sum(p.default is p.empty for p in parameters)
        kept = {key: values for key, values in fixed.items() if key not in names}
        gm.register_forward_pre_hook(_InputNames(names, required, kept), with_kwargs=True)
        keep_in_copies(gm)


class _InputNames:
    """Forward pre-hook: the call binds to ``names``; ``tails[i]`` is the set of names a call giving
    ``i`` inputs by position gives by name when it gives all of them."""

    def __init__(self, names: tuple[str, ...], required: int, fixed: dict[str, list[Any]]) -> None:
        self.names, self.required, self.fixed = names, required, fixed
        self.tails = [frozenset(names[count:]) for count in range(len(names) + 1)]

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        if kwargs:
            if len(args) < len(self.tails) and kwargs.keys() == self.tails[len(args)]:
                return None
            if not kwargs.keys().isdisjoint(self.fixed):
                kwargs = {key: value for key, value in kwargs.items() if not self._fixed(key, value)}
                check_call(self.names, args, kwargs, self.required)
                return args, kwargs
        elif len(args) == len(self.names):
            return None
        check_call(self.names, args, kwargs, self.required)
        return None

    def _fixed(self, key: str, value: Any) -> bool:
        """Whether ``key`` is a keyword the capture fixed at ``value``; another value raises."""
        if key not in self.fixed:
            return False
        if any(same_value(value, fixed) for fixed in self.fixed[key]):
            return True
        raise InputMismatchError(fixed_refusal(key, value, self.fixed[key], self.names))
