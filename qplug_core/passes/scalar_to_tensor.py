"""Schema-driven argument rewrite: Python scalars passed where an ATen op expects a Tensor.

ATen graphs from ``torch.export`` call e.g. ``aten.add.Tensor(x, 1)``; backends that only accept
tensors need ``aten.add.Tensor(x, tensor(1))``. The op's ``_schema`` says which arguments are
Tensors, so the rewrite needs no per-op table. Non-ATen targets are left alone.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.fx import GraphModule

from qplug_core.passes.transformer import MetaTransformer, TransformerPass

__all__ = ["ScalarToTensorPass", "map_schema_args"]

_SCALARS = (bool, int, float)


def map_schema_args(target: Any, fn: Callable[[Any, Any], Any],
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Apply ``fn(value, schema_argument)`` to every argument of an ATen op (``target._schema``)."""
    new_args, new_kwargs = list(args), dict(kwargs)
    for i, arg in enumerate(target._schema.arguments):
        if arg.name in new_kwargs:
            new_kwargs[arg.name] = fn(new_kwargs[arg.name], arg)
        elif not arg.kwarg_only and i < len(new_args):
            new_args[i] = fn(new_args[i], arg)
    return tuple(new_args), new_kwargs


def _coerce(value: Any, arg: Any) -> Any:
    if isinstance(value, _SCALARS) and isinstance(arg.type, torch.TensorType):
        return torch.tensor(value)
    return value


class _ScalarToTensor(MetaTransformer):
    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(getattr(target, "_schema", None), torch.FunctionSchema):
            new_args, new_kwargs = map_schema_args(target, _coerce, args, kwargs)
            if any(a is not b for a, b in zip(new_args, args)) or any(
                    new_kwargs[k] is not kwargs[k] for k in kwargs):
                self.changed = True
                args, kwargs = new_args, new_kwargs
        return super().call_function(target, args, kwargs)


class ScalarToTensorPass(TransformerPass):
    """Turn scalar arguments of ATen ops into 0-d tensor constants where the schema wants a Tensor."""

    def make_transformer(self, graph_module: GraphModule) -> MetaTransformer:
        return _ScalarToTensor(graph_module)
