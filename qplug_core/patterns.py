"""The fusion/quantization pattern format: checking, converting, ordering and printing patterns.

A pattern describes a small subgraph by its *last* node (the anchor), in the reversed nested tuple
("complex") format inherited from ``torch.ao.quantization``::

    Pattern = op | (op, Pattern, Pattern, ...)

The first element matches the anchor node; the others match ``node.args[0], node.args[1], ...``.
``op`` is an ``nn.Module`` subclass (``call_module``), a callable (``call_function``, compared
by identity), a ``str`` (``call_method`` name), :class:`MatchAllNode` (any input),
``(getattr, "name")`` (an attribute read such as ``x.shape``) or, as an argument sub-pattern only,
a literal value compared with ``==``. Backend configs may also use the forward "simple" format
``op | (a, b) | (a, b, c)`` (a -> b -> c in dataflow order), which :func:`to_complex_format`
converts.

The matcher trusts patterns that passed :func:`validate_pattern`, so every malformed pattern is
rejected here with a :class:`~qplug_core.errors.PatternError` whose ``position`` (indices into the
nested tuples) locates the offending element.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeAlias

import torch
from torch import nn

from qplug_core.errors import PatternError

__all__ = [
    "MatchAllNode",
    "Pattern",
    "describe",
    "format_pattern",
    "is_match_all",
    "pattern_size",
    "sort_patterns",
    "to_complex_format",
    "to_simple_format",
    "validate_pattern",
]

Pattern: TypeAlias = Any
"""A pattern in either format; its real grammar is richer than a static type can say (see above)."""

Position = tuple[int, ...]


class MatchAllNode:
    """Wildcard for a pattern argument: matches any input (node or literal) without absorbing it.

    Use the class itself in patterns, e.g. ``(operator.add, MatchAllNode, nn.Conv2d)``; the node it
    matches is an *input* of the match, never a member (not fused, not deleted).
    """


_LITERAL_TYPES: tuple[type, ...] = (
    bool, int, float, complex, str, type(None), type(Ellipsis),
    torch.dtype, torch.device, torch.memory_format, torch.layout,
)


def is_match_all(element: Any) -> bool:
    """True for MatchAllNode or a subclass of it (rule 5), the class not an instance."""
    return isinstance(element, type) and issubclass(element, MatchAllNode)


def describe(element: Any) -> str:
    """Python-like text of any pattern element, even a malformed one, with short names."""
    if isinstance(element, tuple):
        inner = ", ".join(describe(item) for item in element)
        return f"({inner},)" if len(element) == 1 else f"({inner})"
    if isinstance(element, list):
        return "[" + ", ".join(describe(item) for item in element) + "]"
    if isinstance(element, type):
        return element.__name__
    if isinstance(element, (nn.Module, MatchAllNode)):
        return f"{type(element).__name__}()"
    if callable(element):
        return _callable_name(element)
    return repr(element)


def _fail(message: str, root: Any, position: Position) -> PatternError:
    where = f" at position {position}" if position else ""
    return PatternError(f"{message}{where} in pattern {describe(root)}", pattern=root,
                        position=position)


# -- validation ------------------------------------------------------------------------------------


def validate_pattern(pattern: Pattern, *, format: Literal["complex", "simple"] = "complex") -> None:
    """Raise :class:`PatternError` if ``pattern`` is not a well-formed pattern in ``format``.

    Checked once when a pattern is registered, so that matching never trips over a malformed
    pattern deep inside a graph walk.
    """
    if format == "complex":
        if is_match_all(pattern) or pattern == (MatchAllNode,):
            raise _fail("A pattern that is only MatchAllNode would match every node; "
                        "use MatchAllNode only as an argument sub-pattern", pattern, ())
        _check_complex(pattern, pattern, (), anchor=True)
    elif format == "simple":
        _check_simple(pattern)
    else:
        raise PatternError(f"Unknown pattern format {format!r}; use 'complex' or 'simple'",
                           pattern=pattern, position=None)


def _check_complex(element: Any, root: Any, position: Position, *, anchor: bool) -> None:
    """Check one element; ``anchor`` is True where a bare element must be an operator."""
    if isinstance(element, tuple):
        _check_tuple(element, root, position)
    else:
        _check_operator(element, root, position, allow_literal=not anchor)


def _check_tuple(element: tuple[Any, ...], root: Any, position: Position) -> None:
    if not element:
        raise _fail("Empty tuple: a pattern tuple needs an anchor operator first, "
                    "e.g. (nn.ReLU, nn.Conv2d)", root, position)
    head = element[0]
    if head is getattr:
        if len(element) != 2 or not isinstance(element[1], str) or not element[1]:
            raise _fail("A getattr pattern needs exactly one attribute name string, "
                        "e.g. (getattr, 'shape')", root, position)
        return
    if isinstance(head, tuple):
        raise _fail("The anchor (first element) must be a single operator, got a tuple; "
                    "nest sub-patterns after the anchor, "
                    "e.g. (nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))",
                    root, position + (0,))
    if is_match_all(head) and len(element) > 1:
        raise _fail("MatchAllNode matches any input and takes no sub-patterns; "
                    "write MatchAllNode alone", root, position + (0,))
    _check_operator(head, root, position + (0,), allow_literal=False)
    for index, sub in enumerate(element[1:], start=1):
        _check_complex(sub, root, position + (index,), anchor=False)


def _check_operator(element: Any, root: Any, position: Position, *, allow_literal: bool) -> None:
    if isinstance(element, list):
        raise _fail(f"Got a list {describe(element)}; patterns use tuples, "
                    f"write {describe(tuple(element))}",
                    root, position)
    if isinstance(element, MatchAllNode):
        raise _fail("Got a MatchAllNode instance; use the class itself: MatchAllNode, "
                    "not MatchAllNode()", root, position)
    if isinstance(element, nn.Module):
        name = type(element).__name__
        raise _fail(f"Got a module instance {name}(); patterns use module classes: "
                    f"write {name}, not {name}()", root, position)
    if element is getattr:
        raise _fail("A bare getattr cannot say which attribute to match; "
                    "write (getattr, 'shape')", root, position)
    if isinstance(element, type) or callable(element) or isinstance(element, str):
        return
    if allow_literal and isinstance(element, _LITERAL_TYPES):
        return
    if isinstance(element, _LITERAL_TYPES):
        raise _fail(f"The literal {element!r} cannot be an anchor; an anchor is a module class, "
                    "a function, a method name or MatchAllNode", root, position)
    raise _fail(f"Unsupported pattern element {describe(element)} of type "
                f"{type(element).__name__}; expected a module class, a function, a method name, "
                "MatchAllNode, a tuple or a literal argument", root, position)


def _check_simple(pattern: Any) -> None:
    if not isinstance(pattern, tuple):
        if isinstance(pattern, list):
            raise _fail(f"Got a list {describe(pattern)}; write the simple pattern as a tuple "
                        f"{describe(tuple(pattern))}", pattern, ())
        _check_simple_op(pattern, pattern, ())
        return
    if len(pattern) not in (2, 3):
        raise PatternError(f"Expected a tuple with 2 or 3 elements, got: {describe(pattern)}; "
                           "longer or branching subgraphs need the complex (reversed nested) "
                           "format",
                           pattern=pattern, position=())
    for index, op in enumerate(pattern):
        _check_simple_op(op, pattern, (index,))


def _check_simple_op(op: Any, root: Any, position: Position) -> None:
    if isinstance(op, tuple):
        raise _fail("A simple-format pattern holds single operators only; use the complex "
                    "format for nested or getattr patterns", root, position)
    if is_match_all(op):
        raise _fail("MatchAllNode has no meaning in the simple format; use the complex format, "
                    "e.g. (operator.add, MatchAllNode, nn.Conv2d)", root, position)
    _check_operator(op, root, position, allow_literal=False)


# -- conversion ------------------------------------------------------------------------------------


def to_complex_format(simple: Pattern) -> Pattern:
    """Convert a forward pattern to the complex format.

    ``op -> op``, ``(a, b) -> (b, a)``, ``(a, b, c) -> (c, (b, a))``; any other tuple length is a
    :class:`PatternError`.
    """
    validate_pattern(simple, format="simple")
    if not isinstance(simple, tuple):
        return simple
    if len(simple) == 2:
        first, second = simple
        return (second, first)
    first, second, third = simple
    return (third, (second, first))


def to_simple_format(complex_pattern: Pattern) -> Pattern:
    """Inverse of :func:`to_complex_format`; a :class:`PatternError` says why there is none.

    Only single operators and chains of two or three operators, each with one argument, have a
    simple form.
    """
    validate_pattern(complex_pattern, format="complex")
    chain: list[Any] = []
    element, position = complex_pattern, ()
    while isinstance(element, tuple):
        if element[0] is getattr:
            raise _fail("getattr patterns have no simple form", complex_pattern, position)
        if len(element) != 2:
            reason = ("a 1-tuple has no simple form; write the operator alone" if len(element) == 1
                      else f"the anchor has {len(element) - 1} argument sub-patterns (a branch)")
            raise _fail(f"No simple form: {reason}", complex_pattern, position)
        chain.append(element[0])
        element, position = element[1], position + (1,)
    if is_match_all(element):
        raise _fail("No simple form: MatchAllNode only exists in the complex format",
                    complex_pattern, position)
    if not (isinstance(element, str) or callable(element)):
        raise _fail(f"No simple form: the literal {element!r} only exists in the complex format",
                    complex_pattern, position)
    chain.append(element)
    if len(chain) > 3:
        raise _fail(f"No simple form: a chain of {len(chain)} operators is longer than 3",
                    complex_pattern, ())
    return chain[0] if len(chain) == 1 else tuple(reversed(chain))


# -- ordering --------------------------------------------------------------------------------------


def pattern_size(pattern: Pattern) -> int:
    """Number of leaves of a (nested) pattern; ``(getattr, "shape")`` counts 2, as in torch.ao."""
    if isinstance(pattern, tuple):
        return sum(pattern_size(item) for item in pattern)
    return 1


def _priority(pattern: Pattern) -> int:
    return -pattern_size(pattern) if isinstance(pattern, tuple) else 1


def sort_patterns(patterns: Iterable[Pattern]) -> list[Pattern]:
    """Patterns in the order a matcher tries them (matching-rules.md rule 13).

    Tuple patterns come before single operators and larger tuples before smaller ones, so that a
    fusion such as conv-relu is found before relu alone; ties keep their given order (stable sort).
    """
    return sorted(patterns, key=_priority)


# -- printing --------------------------------------------------------------------------------------

_MODULE_PREFIXES = {
    "torch.nn.functional": "F.",
    "torch._C._nn": "F.",
    "torch": "torch.",
    "_operator": "operator.",
    "operator": "operator.",
    "builtins": "",
}


def _callable_name(op: Callable[..., Any]) -> str:
    module = getattr(op, "__module__", None) or ""
    if module.startswith("torch._ops"):  # OpOverload / OpOverloadPacket print as aten.relu.default
        return str(op)
    name = getattr(op, "__name__", None) or repr(op)
    if module in _MODULE_PREFIXES:
        return _MODULE_PREFIXES[module] + name
    qualname = getattr(op, "__qualname__", name)
    return f"{module}.{qualname}" if module else qualname


def _leaf_name(op: Any) -> str:
    if is_match_all(op):
        return "*"
    if isinstance(op, type):
        # qplug's QAT modules share their float modules' names: tell them apart
        return f"qat.{op.__name__}" if op.__module__.startswith("qplug_core.nn.qat") else op.__name__
    if isinstance(op, str):
        return f".{op}()"
    if callable(op):
        return _callable_name(op)
    return repr(op)


def _call_name(op: Any) -> str:
    """Name of an anchor written with an argument list: ``.add(...)``, not ``.add()(...)``."""
    return f".{op}" if isinstance(op, str) else _leaf_name(op)


def format_pattern(pattern: Pattern) -> str:
    """Render a complex-format pattern as a short, deterministic, unambiguous string.

    ``X <- Y`` means "X applied to the output of Y" (one argument); anchors with several arguments
    are written as calls ``operator.add(*, Conv2d)``; ``*`` is MatchAllNode, ``.relu()`` a method
    call, ``.shape`` a getattr pattern and literals use ``repr``. Example::

        (nn.ReLU, (operator.add, MatchAllNode, (nn.BatchNorm2d, nn.Conv2d)))
        -> "ReLU <- operator.add(*, BatchNorm2d <- Conv2d)"
    """
    if not isinstance(pattern, tuple):
        return _leaf_name(pattern)
    if not pattern:
        return "()"
    head, args = pattern[0], pattern[1:]
    if head is getattr and len(args) == 1:
        return f".{args[0]}" if isinstance(args[0], str) else f"getattr({args[0]!r})"
    if not args:
        return f"({_leaf_name(head)},)"
    if len(args) == 1:
        return f"{_leaf_name(head)} <- {format_pattern(args[0])}"
    return f"{_call_name(head)}({', '.join(format_pattern(arg) for arg in args)})"
