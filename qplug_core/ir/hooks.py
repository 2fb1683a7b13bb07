"""Removing a module's forward pre-hooks by what they are.

A guard qplug puts on a model (a check of its inputs) is installed again when the model is
converted or loaded: the copy a conversion starts from carries the observed model's, which must
make way for the new one, registered after the hooks conversion adds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["drop_pre_hooks"]


def drop_pre_hooks(module: nn.Module, matches: Callable[[Any], bool]) -> None:
    """Remove every forward pre-hook of ``module`` (with or without kwargs) that ``matches``."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if matches(hook):
            del module._forward_pre_hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)
