"""Whether a call's keyword gives the value the capture fixed it at, and what to do when it does not.

``q(x, scale=1)`` on a model captured with ``scale=1.0`` is the call the float model answers the
same, so it is taken; ``q(**tokenizer(text))`` giving ``token_type_ids`` where the capture left it at
``None`` needs that tensor to be an input of the int8 model, which only ``example_inputs`` makes it.
Another constant is captured by quantizing ``functools.partial(model, key=value)``
(:mod:`qplug_core.flows.method_views`), which the message spells out with the call's own value.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

__all__ = ["fixed_refusal", "same_value"]


def same_value(value: Any, fixed: Any) -> bool:
    """Python's equality for the constants a capture fixes (a 0-dim tensor as its number), except
    that a bool only equals a bool (``True == 1``, but ``if flag`` and ``* scale`` differ)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:  # a shaped tensor broadcasts: not the same as a number
            return False
        value = value.item()
    if value is None or fixed is None:
        return value is fixed
    if isinstance(value, bool) or isinstance(fixed, bool):
        return isinstance(value, bool) and isinstance(fixed, bool) and value == fixed
    return isinstance(value, numbers.Real) and isinstance(fixed, numbers.Real) and value == fixed


def fixed_refusal(key: str, value: Any, accepted: list[Any], inputs: tuple[str, ...]) -> str:
    """The message for a call giving ``key=value`` where the capture fixed ``accepted[0]`` (a second
    entry, None, means the value came from the model's config: ``model.config.<key>`` exists)."""
    used = accepted[0]
    head = (f"the int8 model has no input {key!r}: it takes ({', '.join(inputs)}), and {key} was fixed at "
            f"{used!r} when it was captured, so it cannot answer a call giving {key}={_shown(value)}")
    if used is None and isinstance(value, torch.Tensor):
        return (f"{head}. To make {key} an input of the int8 model, add it to example_inputs (in forward's "
                "parameter order) and to each calibration batch before qp.quantize; docs/guide/export.md")
    partial = (f"pass functools.partial(model, {key}={_shown(value)}) to qp.quantize in place of the model "
               f"(the int8 model then takes {key}={_shown(value)})")
    if len(accepted) > 1:
        return f"{head}. To quantize with it, set model.config.{key} before qp.quantize or {partial}; docs/guide/export.md"
    if used is None:
        return (f"{head}; what the model does for None is known only by running it, so qplug takes only "
                f"{key}=None (or leaving it out). To quantize with {_shown(value)}, {partial}; docs/guide/export.md")
    return f"{head}. To quantize with it, {partial}; docs/guide/export.md"


def _shown(value: Any) -> str:
    """A constant as written; a tensor by shape and dtype (its contents can be thousands of lines)."""
    if isinstance(value, torch.Tensor):
        return f"<tensor of shape {tuple(value.shape)}, {str(value.dtype).removeprefix('torch.')}>"
    text = repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__}>"
