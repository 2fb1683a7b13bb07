"""The float ``weight`` a quantized linear shows to model code that reads it.

Model code reads ``self.wo.weight`` (T5's feed-forward checks its dtype several times in every
forward, ``nn.TransformerEncoderLayer`` its device), so a swapped-in linear must have one. Making
the float copy at each read would dequantize the whole matrix several times per call, and keeping
one would hold a float copy of every weight beside the int8 one. :class:`FloatWeightView` knows its
dtype, shape and device without computing anything; the first torch op that reads its values
gets them made from the quantized weight as it is then, and they are dropped with the op's result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from qplug_core.errors import ModelStateError


class FloatWeightView(torch.Tensor):
    """A read-only float32 tensor whose values ``make()`` gives when an op reads them.

    Writing to it (``weight.zero_()``, ``weight.data.mul_(0)``, ``weight.copy_(w)``) raises
    :class:`ModelStateError`: the layer computes with its quantized weight, so a write could only
    be lost (pruning or editing a quantized layer in place looked applied and changed nothing)."""

    _make: Callable[[], torch.Tensor]

    @staticmethod
    def __new__(cls, make: Callable[[], torch.Tensor], shape: tuple[int, ...], device: torch.device
                ) -> FloatWeightView:
        view = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=device)
        view._make = make
        return view

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Defined, not disabled: torch's fast paths decline tensors with a torch function, so
        ``nn.TransformerEncoderLayer`` in eval calls the layer's own forward (its int8 kernel)
        rather than computing in float with these values."""
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def values(view: FloatWeightView) -> torch.Tensor:
            return view._make()

        def compute() -> Any:
            return func(*tree_map_only(cls, values, args), **tree_map_only(cls, values, kwargs or {}))

        _refuse_writes(func, args, kwargs or {})
        result = compute()
        if not _returns_alias(func):
            return result
        if isinstance(result, torch.Tensor):
            return _aliasing(compute, result)
        return type(result)(_aliasing(lambda i=i: compute()[i], part) for i, part in enumerate(result))

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"FloatWeightView({self._make()!r})"


def _returns_alias(func: Any) -> bool:
    """``w.data``, ``w.detach()``, ``w[0]``, ``w.t()``: a result that shares the weight's memory."""
    return any(ret.alias_info is not None for ret in func._schema.returns)


def _aliasing(compute: Callable[[], torch.Tensor], result: torch.Tensor) -> torch.Tensor:
    """An alias of a view is a view too, so ``w.data.mul_(0)`` and ``w[0] = 1`` are refused like
    ``w.mul_(0)`` rather than writing to a temporary."""
    if result.dtype != torch.float32:
        return result
    return FloatWeightView(compute, tuple(result.shape), result.device)


def _refuse_writes(func: Any, args: tuple, kwargs: dict) -> None:
    """Raise when ``func`` writes to a view: its schema marks the arguments it mutates."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if isinstance(value, FloatWeightView):
            raise ModelStateError(
                f"a quantized layer's weight is a read-only float view of its int8 weight: "
                f"{func._schema.name} would write to a temporary copy and change nothing. Edit the "
                "float model's weight and quantize it again")
