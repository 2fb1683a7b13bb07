"""An int8 model computes in float32 under the caller's ``torch.autocast``.

Its float ops between int8 layers feed quantize ops, which take float32 only: under
``torch.autocast("cpu", dtype=torch.bfloat16)`` a static BERT on fbgemm raised torch's "Quantize
only works on Float Tensor, got BFloat16", and a dynamic one an ``InputMismatchError`` telling the
caller, who had passed int64 ids, to pass ``.float()``. Autocast cannot make an int8 model faster,
so the model turns it off for its own forward, as the delegate path's compile and check do: a call
under autocast answers bit-identically to a plain one. Two hooks on the root: one C call per
forward when autocast is off.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from qplug_core.ir.hooks import keep_in_copies

__all__ = ["compute_in_float32"]

_CALLS = threading.local()


class _AutocastOff:
    """Forward pre-hook: turn CPU autocast off for the model's forward, if the caller had it on."""

    def __call__(self, module: nn.Module, args: Any) -> None:
        off = None
        if torch.is_autocast_enabled("cpu"):
            off = torch.autocast("cpu", enabled=False)
            off.__enter__()
        _CALLS.__dict__.setdefault("stack", []).append(off)


def _restore_autocast(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook (always called, also on errors): give the caller its autocast back."""
    off = _CALLS.stack.pop()
    if off is not None:
        off.__exit__(None, None, None)


def compute_in_float32(model: nn.Module) -> nn.Module:
    """Make ``model``'s forward run with CPU autocast off whatever its caller has on; returns it.
    The pre-hook goes first, so no other pre-hook can raise before it (the forward hook that
    restores autocast is called whenever the forward started)."""
    if not any(isinstance(hook, _AutocastOff) for hook in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(_AutocastOff(), prepend=True)
        model.register_forward_hook(_restore_autocast, always_call=True)
        keep_in_copies(model)
    return model
