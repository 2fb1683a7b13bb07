"""Eager mode's input observers: a plain attribute of the observed module, not a child.

Fused modules are ``nn.Sequential``\\ s, which would run a child observer on their *output*; so the
observer of a module's input lives in ``module.__dict__[INPUT_OBSERVER]``, fed by a forward
pre-hook. Being no child, it would miss what children get for free: the state dict hooks below
save and load it under ``<module>.activation_pre_process.``, as if it were one (a mid-QAT
checkpoint resumes exactly), and the fake-quant toggles reach it (see
:func:`qplug_core.observers.fake_quantize.hidden_fake_quants`). In a QAT model it is the qconfig's
fake quant, so ``disable_observer`` freezes it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qplug_core.flows.tags import EAGER_INPUT_REQUANTIZED

INPUT_OBSERVER = "activation_pre_process"


def observe_input(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook: record the first input's range. The input is left unchanged, except in a
    QAT model where a backend rule narrowed it: there it is fake-quantized to the narrowed qparams
    convert will requantize it to."""
    if not (args and isinstance(args[0], torch.Tensor)):
        return None
    observer = module.__dict__[INPUT_OBSERVER]
    if module.__dict__.get(EAGER_INPUT_REQUANTIZED) == "qat":
        return (observer(args[0]), *args[1:])
    observer(args[0].detach())
    return None


def save_input_observer(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                        local_metadata: Any) -> None:
    """State dict post-hook: the input observer's state under ``<prefix>activation_pre_process.``."""
    observer = module.__dict__.get(INPUT_OBSERVER)
    if observer is not None:
        observer.state_dict(destination=state_dict, prefix=f"{prefix}{INPUT_OBSERVER}.")


def load_input_observer(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                        local_metadata: Any, strict: bool, missing_keys: list[str],
                        unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Load-state-dict pre-hook: restore what :func:`save_input_observer` saved. A checkpoint
    written before qplug saved them has no such keys: the observer starts afresh, as it did."""
    observer = module.__dict__.get(INPUT_OBSERVER)
    own = f"{prefix}{INPUT_OBSERVER}."
    keys = [key for key in state_dict if key.startswith(own)]
    if observer is None or not keys:
        return  # no observer: the keys stay and torch reports them as unexpected
    result = observer.load_state_dict({key[len(own):]: state_dict.pop(key) for key in keys},
                                      strict=False)
    unexpected_keys.extend(own + key for key in result.unexpected_keys)


def attach_input_observer(module: nn.Module, observer: nn.Module) -> None:
    module.__dict__[INPUT_OBSERVER] = observer
    module.register_forward_pre_hook(observe_input, prepend=True)
    module.register_state_dict_post_hook(save_input_observer)
    module.register_load_state_dict_pre_hook(load_input_observer)


def without_input_observer(module: nn.Module) -> None:
    """Remove the observer and its hooks from ``module`` (a shallow copy: hook dicts are replaced,
    not edited)."""
    module.__dict__.pop(INPUT_OBSERVER, None)
    module._forward_pre_hooks = type(module._forward_pre_hooks)(
        (k, h) for k, h in module._forward_pre_hooks.items() if h is not observe_input)
    module._state_dict_hooks = type(module._state_dict_hooks)(
        (k, h) for k, h in module._state_dict_hooks.items() if h is not save_input_observer)
    module._load_state_dict_pre_hooks = type(module._load_state_dict_pre_hooks)(
        (k, h) for k, h in module._load_state_dict_pre_hooks.items()
        if getattr(h, "hook", h) is not load_input_observer)
