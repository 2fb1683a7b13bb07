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


class FloatWeightView(torch.Tensor):
    """A read-only float32 tensor whose values ``make()`` gives when an op reads them.

    Writing to it (``weight.add_(1)``) writes to a temporary copy: the layer computes with its
    quantized weight, as ``DynamicLinear.weight`` does."""

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

        return func(*tree_map_only(cls, values, args), **tree_map_only(cls, values, kwargs or {}))

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"FloatWeightView({self._make()!r})"
