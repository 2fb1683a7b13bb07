"""Which nodes a backend can run: composable ``OperatorSupport`` rules for the partitioner.

Same contract as ``torch.fx.passes.operator_support``: ``is_node_supported(submodules, node)``;
``chain`` combines rules with *all*, ``any_chain`` with *any*. Support-dict keys may be the target
itself (``torch.ops.aten.add.Tensor``, ``operator.add``, ``nn.Conv2d``, a method name) or its
qualified name as torch spells it (``"torch.ops.aten.add.Tensor"``, ``"_operator.add"``).
"""

from __future__ import annotations

import abc
import builtins
from typing import Any, Callable, Mapping, Sequence, Tuple

import torch
from torch import nn
from torch.fx import Node

from qplug_core.errors import GraphError

__all__ = ["OperatorSupportBase", "OperatorSupport", "TensorDtypeRule", "create_op_support",
           "chain", "any_chain", "OpSupports", "qualified_name", "node_dtype"]

CALLABLE_OPS = frozenset({"call_function", "call_method", "call_module"})

# (dtypes allowed for each positional arg, or None to skip it; dtypes allowed per kwarg name)
TensorDtypeRule = Tuple[Sequence[Sequence[torch.dtype] | None], Mapping[str, Sequence[torch.dtype]]]
Submodules = Mapping[str, nn.Module]


def qualified_name(target: Any) -> str:
    """The dotted name torch uses for a call target (``torch.ops.aten.add.Tensor``, ``_operator.add``)."""
    if isinstance(target, str):
        return target
    if isinstance(getattr(target, "_schema", None), torch.FunctionSchema):
        return f"torch.ops.{target}"
    name = getattr(target, "__name__", type(target).__name__)
    if getattr(builtins, name, None) is target:
        return name
    if getattr(torch.Tensor, name, None) is target:
        return f"torch.Tensor.{name}"
    module = getattr(target, "__module__", None) or ""
    if module.startswith("torch._C._VariableFunctions") or module == "torch._C":
        module = "torch"
    return f"{module.replace('torch._ops', 'torch.ops')}.{name}".lstrip(".")


def node_dtype(node: Node) -> torch.dtype:
    """The dtype a node produces, from ``tensor_meta`` / ``val`` metadata."""
    for key in ("tensor_meta", "val"):
        dtype = getattr(node.meta.get(key), "dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
    if isinstance(node.meta.get("type"), torch.dtype):
        return node.meta["type"]
    raise GraphError(f"node {node.name!r} has no dtype metadata; capture the model with "
                     "capture_aten (which records it) or run shape propagation first.",
                     node=node.name)


class OperatorSupportBase(abc.ABC):
    """Decides whether the backend can run ``node``."""

    @abc.abstractmethod
    def is_node_supported(self, submodules: Submodules, node: Node) -> bool:
        """True if ``node`` may go into a partition."""

    def unsupported_reason(self, submodules: Submodules, node: Node) -> str | None:
        """Why ``node`` may not go into a partition, for the report (None: no more than that the
        backend does not take it)."""
        return None


class _FunctionSupport(OperatorSupportBase):
    def __init__(self, fn: Callable[[Submodules, Node], bool], name: str) -> None:
        self._fn = fn
        self._name = name

    def is_node_supported(self, submodules: Submodules, node: Node) -> bool:
        return self._fn(submodules, node)

    def __repr__(self) -> str:
        return self._name


def create_op_support(fn: Callable[[Submodules, Node], bool]) -> OperatorSupportBase:
    """Wrap a ``fn(submodules, node) -> bool`` as an :class:`OperatorSupportBase`."""
    return _FunctionSupport(fn, getattr(fn, "__name__", "op_support"))


class OperatorSupport(OperatorSupportBase):
    """Support by target, optionally restricted by input dtypes.

    ``support_dict`` maps a target (or its qualified name) to ``None`` (any dtype) or a
    :data:`TensorDtypeRule`. Non-call nodes (placeholder, get_attr, output) are reported as
    supported, as torch does; the partitioner never puts them into a partition.
    """

    def __init__(self, support_dict: Mapping[Any, TensorDtypeRule | None] | None = None) -> None:
        self._rules: dict[Any, TensorDtypeRule | None] = dict(support_dict or {})

    def _rule_key(self, submodules: Submodules, node: Node) -> Any:
        if node.op == "call_module":
            cls = type(submodules[str(node.target)])
            candidates: tuple[Any, ...] = (cls, f"{cls.__module__}.{cls.__name__}")
        elif node.op == "call_method":
            candidates = (node.target,)
        else:
            candidates = (node.target, qualified_name(node.target))
        return next((c for c in candidates if c in self._rules), None)

    def is_node_supported(self, submodules: Submodules, node: Node) -> bool:
        if node.op not in CALLABLE_OPS:
            return True
        key = self._rule_key(submodules, node)
        if key is None:
            return False
        rule = self._rules[key]
        if rule is None:
            return True
        args_dtypes, kwargs_dtypes = rule
        for arg, dtypes in zip(node.args, args_dtypes):
            if dtypes is not None and isinstance(arg, Node) and node_dtype(arg) not in dtypes:
                return False
        for name, dtypes in kwargs_dtypes.items():
            arg = node.kwargs.get(name)
            if isinstance(arg, Node) and node_dtype(arg) not in dtypes:
                return False
        return True


def chain(*supports: OperatorSupportBase) -> OperatorSupportBase:
    """Supported only if every rule says so."""
    return _FunctionSupport(lambda sm, n: all(s.is_node_supported(sm, n) for s in supports),
                            f"chain{supports!r}")


def any_chain(*supports: OperatorSupportBase) -> OperatorSupportBase:
    """Supported if any rule says so."""
    return _FunctionSupport(lambda sm, n: any(s.is_node_supported(sm, n) for s in supports),
                            f"any_chain{supports!r}")


class OpSupports:
    """Ready-made atomic rules to combine with :func:`chain` / :func:`any_chain`."""

    @staticmethod
    def decline_if_input_dtype(dtype: torch.dtype) -> OperatorSupportBase:
        """Unsupported when any input node produces ``dtype``."""
        return _FunctionSupport(
            lambda sm, n: all(node_dtype(a) != dtype for a in n.all_input_nodes),
            f"decline_if_input_dtype({dtype})")

    @staticmethod
    def decline_if_node_in_names(names: set[str] | frozenset[str]) -> OperatorSupportBase:
        """Unsupported when the node's name is in ``names``."""
        frozen = frozenset(names)
        return _FunctionSupport(lambda sm, n: n.name not in frozen,
                                f"decline_if_node_in_names({sorted(frozen)})")
