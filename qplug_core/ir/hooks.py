"""The forward hooks qplug puts on a model: removed by what they are, kept by deep copies.

A guard qplug puts on a model (a check of its inputs) is installed again when the model is
converted or loaded: the copy a conversion starts from carries the observed model's, which must
make way for the new one, registered after the hooks conversion adds. ``copy.deepcopy`` of a
``GraphModule`` keeps only its state-dict hooks (torch.fx's ``__deepcopy__``), so a copy of a
converted model lost the engine it runs under and its input checks (per-worker copies and A/B
setups deep-copy models: qnnpack's ``add_relu`` then ran under the global engine, and answered
otherwise); :func:`keep_in_copies` carries them over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx, nn

__all__ = ["copy_forward_hooks", "drop_pre_hooks", "keep_in_copies"]

#: the module attributes that hold forward hooks and how they are called
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def drop_pre_hooks(module: nn.Module, matches: Callable[[Any], bool]) -> None:
    """Remove every forward pre-hook of ``module`` (with or without kwargs) that ``matches``."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if matches(hook):
            del module._forward_pre_hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)


class _ForwardHooksOnCopy:
    """A ``GraphModule`` deep-copy hook: the copy calls the hooks ``model`` calls (the same hook
    objects: qplug's are stateless)."""

    def __init__(self, model: fx.GraphModule) -> None:
        self.model = model

    def __call__(self, copy: fx.GraphModule) -> None:
        copy_forward_hooks(self.model, copy)


def copy_forward_hooks(source: nn.Module, target: nn.Module) -> None:
    """Make ``target`` call the forward hooks ``source`` calls (the same hook objects), and no others."""
    for attr in _FORWARD_HOOKS:
        if hasattr(source, attr):
            setattr(target, attr, type(getattr(source, attr))(getattr(source, attr)))


def keep_in_copies(model: nn.Module) -> None:
    """Make deep copies of ``model`` (a GraphModule) keep its forward hooks; idempotent. A torch
    without GraphModule deep-copy hooks (before 2.5) copies the model without them, as it did."""
    register = getattr(model, "_register_deepcopy_hook", None)
    if register is None or any(isinstance(h, _ForwardHooksOnCopy) for h in model._deepcopy_hooks):
        return
    register(_ForwardHooksOnCopy(model))
