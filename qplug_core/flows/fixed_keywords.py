"""Keyword arguments a capture left at their value, which a call of the int8 model may still name.

A captured graph takes the example's inputs only; ``forward``'s other parameters were fixed at
their defaults, and a Hugging Face model's call options (``return_dict``, ``output_attentions``,
``output_hidden_states``) at its config's values. A call naming one at that same value
(``q(pixel_values=x, return_dict=True)``, as the float model is called) changes nothing and is
taken; another value is refused by :mod:`qplug_core.ir.call_inputs`, which says how to capture it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from qplug_core.flows.tags import BAKED_TYPES

__all__ = ["fixed_keywords"]

#: the call options a Hugging Face model reads from its config when a call leaves them out (None)
CONFIG_OPTIONS = ("return_dict", "output_attentions", "output_hidden_states")


def fixed_keywords(model: nn.Module, given: int) -> dict[str, list[Any]]:
    """Keyword -> [the value the capture used, and None when None meant that value] for the
    ``forward`` parameters after the ``given`` example inputs whose value is a plain constant."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature: nothing is known
        return {}
    config = getattr(model, "config", None)
    fixed: dict[str, list[Any]] = {}
    for p in parameters[given:]:
        default = _number(p.default)
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and _constant(default):
            fixed[p.name] = _used(default, getattr(config, p.name, None))
    if config is not None and any(p.kind is p.VAR_KEYWORD for p in parameters):
        for name in CONFIG_OPTIONS:
            if name not in fixed and _constant(getattr(config, name, inspect.Parameter.empty)):
                fixed[name] = _used(None, getattr(config, name))
    return fixed


def _used(default: Any, configured: Any) -> list[Any]:
    """A None default stands for the config's value (Hugging Face's convention)."""
    return [configured, None] if default is None and configured is not None and _constant(configured) else [default]


def _number(value: Any) -> Any:
    """A 0-dim tensor as its number (``functools.partial(model, scale=torch.tensor(2.0))``: export
    builds it in as a constant, and :func:`~qplug_core.ir.fixed_values.same_value` compares so)."""
    return value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value


def _constant(value: Any) -> bool:
    return type(value) in BAKED_TYPES
