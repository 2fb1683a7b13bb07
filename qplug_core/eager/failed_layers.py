"""An eager-converted model's int8 layer whose call fails says which layer it is.

Eager convert puts the backend's kernels (plugin classes) into the user's own model, so a failing
call met the kernel's words (qplug's "int8 Conv2d takes inputs with 3 channels", torch's "Quantize
only works on Float Tensor, got Double") naming no layer, where the module-swapped layers
(:class:`~qplug_core.kernels.layer_faults.ExplainedLayer`) name theirs. :func:`name_failures`
wraps each swapped module's ``forward`` on the instance (its class is the backend's, shared by
other models): nothing runs while calls succeed; a refusal by qplug's kernel, or a float input of
another dtype than float32 (what quantizing takes, as the float layer after the stub takes only
its weight's dtype), is raised as :class:`~qplug_core.errors.InputMismatchError` naming the layer
(:func:`~qplug_core.kernels.layer_faults.explained_error`); any other error is raised as it was.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from qplug_core.kernels.layer_faults import ExplainedLayer, Fault, explained_error, wrong_dtype

__all__ = ["name_failures"]


def name_failures(model: nn.Module, names: set[str]) -> None:
    """Make the modules of ``model`` called ``names`` (its swapped ones) name themselves when a call fails."""
    for name, module in model.named_modules():
        if name in names and not isinstance(module, ExplainedLayer) and "forward" not in vars(module):
            # a partial of a module-level function: the model still deep-copies and pickles
            module.forward = functools.partial(_named_forward, module, name)


def _named_forward(module: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return type(module).forward(module, *args, **kwargs)
    except Exception as error:
        instead = explained_error(module, name, error, lambda: _float_input_fault(args))
        if instead is None:
            raise
        raise instead from error


def _float_input_fault(args: tuple) -> Fault | None:
    """A float (not quantized) first input that is not float32: quantizing takes float32 only."""
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and not x.is_quantized:
        return wrong_dtype(x, torch.float32)
    return None
