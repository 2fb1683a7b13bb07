"""Reading ``node.meta["nn_module_stack"]`` in either of the two forms torch writes it.

Symbolic tracing writes ``{path: (path, module class)}`` without the root; ``torch.export``
writes ``{key: (path, "module.QualifiedName")}`` with a root entry ``("", ...)`` and keys that are
not paths (``L__self__model``). qplug leaves both as torch made them: a graph handed back to
torch (``torch.export`` of a partition, which the ONNX exporter runs) is checked against export's
form, and a class or ``None`` where export writes a string fails that check. So passes read the
stack through these helpers instead of relying on one form, and nodes qplug creates get entries in
the form the graph already uses (:func:`entry`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import fx

KEY = "nn_module_stack"
#: keys torch.export writes for nodes outside any module (shape guards); not a module scope
_NO_SCOPE_PREFIX = "_empty_nn_module_stack"


def type_name(module_type: Any) -> str:
    """The qualified class name export records for ``module_type`` (a class or already a name)."""
    if isinstance(module_type, str):
        return module_type
    return f"{module_type.__module__}.{module_type.__qualname__}"


def scopes(node: fx.Node) -> list[tuple[str, Any]]:
    """``(path, class or qualified class name)`` of each module around ``node``, outermost first;
    the root module and export's scope-less placeholders left out."""
    stack = node.meta.get(KEY) or {}
    return [(path, module_type) for key, (path, module_type) in stack.items()
            if path and not str(key).startswith(_NO_SCOPE_PREFIX)]


def innermost(node: fx.Node) -> tuple[str, Any]:
    """``(path, type)`` of the module whose forward created ``node`` (``("", None)``: the root)."""
    found = scopes(node)
    return found[-1] if found else ("", None)


def entry(stack: dict[str, Any], path: str, module_type: type) -> tuple[str, tuple[str, Any]]:
    """The ``(key, value)`` to add to ``stack`` for a module at ``path``, in the form ``stack`` is
    in: export's (string class names) when any value holds a string, the tracer's otherwise."""
    exported = any(isinstance(value[1], str) for value in stack.values())
    return path, (path, type_name(module_type) if exported else module_type)


def resolve_type(module_type: Any, candidates: Iterable[Any]) -> Any:
    """The class among ``candidates`` (a qconfig mapping's keys, say) that ``module_type`` names.

    A class is returned as it is; a qualified name from an exported graph is matched by name, so
    a qconfig set for a module type applies at both capture levels without resolving names.
    """
    if not isinstance(module_type, str):
        return module_type
    for candidate in candidates:
        if isinstance(candidate, type) and type_name(candidate) == module_type:
            return candidate
    return None


__all__ = ["KEY", "entry", "innermost", "resolve_type", "scopes", "type_name"]
