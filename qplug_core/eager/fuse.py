"""Eager-mode fusion: replace named module groups (conv, bn, relu) by one fused module.

The fuser for a group is looked up by its module types in
:data:`qplug_core.nn.fuser_methods.DEFAULT_FUSER_METHODS`; the fused module goes where the first
name was and ``nn.Identity`` where the others were, so the model's ``forward`` keeps working
unchanged (torch.ao ``fuse_modules`` semantics).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn
from torch.nn.utils.parametrize import type_before_parametrizations

from qplug_core.errors import ConfigError, ConfigValidationError, PatternError, did_you_mean
from qplug_core.flows.checks import check_model
from qplug_core.nn.computed_weights import without_computed_weights
from qplug_core.nn.fuser_methods import FuserMethod, get_fuser_method


def _groups(modules_to_fuse: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """One group (a list of names) or a list of groups, validated."""
    if isinstance(modules_to_fuse, str) or not isinstance(modules_to_fuse, Sequence):
        raise ConfigValidationError(
            f"modules_to_fuse must be a list of module names or a list of such lists, got "
            f"{modules_to_fuse!r}", field="modules_to_fuse", value=modules_to_fuse)
    groups = [modules_to_fuse] if all(isinstance(n, str) for n in modules_to_fuse) else modules_to_fuse
    result = []
    for group in groups:
        if isinstance(group, str) or not all(isinstance(n, str) for n in group) or len(group) < 2:
            raise ConfigValidationError(
                f"each group in modules_to_fuse must list at least two module names, got {group!r}",
                field="modules_to_fuse", value=group)
        result.append(list(group))
    return result


def _drop_hooks(registered: dict, moved: list) -> None:
    for key in [k for k, hook in registered.items() if any(hook is m for m in moved)]:
        del registered[key]


def _fuse_group(model: nn.Module, group: list[str], named: dict[str, nn.Module], is_qat: bool,
                fuser_func: FuserMethod | None) -> None:
    for name in group:
        if name not in named or not name:
            raise ConfigError(
                f"fuse_modules: {type(model).__name__} has no submodule {name!r}"
                f"{did_you_mean(name, [n for n in named if n])}; names are dotted paths as in "
                "model.named_modules()", field="modules_to_fuse", value=name)
    modules = [named[name] for name in group]
    types = tuple(type_before_parametrizations(m) for m in modules)
    try:
        fuser = fuser_func or get_fuser_method(types)
        fused = fuser(is_qat, *modules)
    except PatternError as error:
        raise PatternError(f"fuse_modules: cannot fuse {group}: {error}", pattern=error.pattern) \
            from error
    except ConfigError as error:
        raise type(error)(f"fuse_modules: cannot fuse {group}: {error}", field=error.field,
                          value=error.value) from error
    # hooks keep their meaning: pre-hooks ran before the first op, forward hooks after the last.
    # They move (as in torch.ao): left on a child of the fused module they would run twice.
    pre_hooks = list(modules[0]._forward_pre_hooks.values())
    hooks = list(modules[-1]._forward_hooks.values())
    for inner in fused.modules():  # the members, or the copies a fuser made of them
        _drop_hooks(inner._forward_pre_hooks, pre_hooks)
        _drop_hooks(inner._forward_hooks, hooks)
    for hook in pre_hooks:
        fused.register_forward_pre_hook(hook)
    for hook in hooks:
        fused.register_forward_hook(hook)
    fused.train(modules[0].training)
    model.set_submodule(group[0], fused)
    for name, module in zip(group[1:], modules[1:]):
        model.set_submodule(name, nn.Identity().train(module.training))


def fuse_modules(model: nn.Module, modules_to_fuse: Sequence[str] | Sequence[Sequence[str]],
                 is_qat: bool = False, inplace: bool = False,
                 fuser_func: FuserMethod | None = None) -> nn.Module:
    """Fuse each group of dotted module names (e.g. ``[["conv1", "bn1", "relu1"], ["fc", "relu"]]``).

    ``is_qat=False`` folds BatchNorm into the weights (the model must be in eval mode);
    ``is_qat=True`` keeps it in a ``ConvBn*``/``LinearBn1d`` for :func:`prepare_qat`. ``fuser_func``
    (signature ``(is_qat, *modules) -> nn.Module``) replaces the type-based lookup for every group.
    The model is copied unless ``inplace=True``.
    """
    check_model(model)
    groups = _groups(modules_to_fuse)
    model, inplace = without_computed_weights(model, inplace=inplace, trainable=is_qat)
    model = model if inplace else copy.deepcopy(model)
    for group in groups:
        _fuse_group(model, group, dict(model.named_modules()), is_qat, fuser_func)
    return model


def fuse_modules_qat(model: nn.Module, modules_to_fuse: Sequence[str] | Sequence[Sequence[str]],
                     inplace: bool = False, fuser_func: FuserMethod | None = None) -> nn.Module:
    """:func:`fuse_modules` with ``is_qat=True`` (BatchNorm kept trainable for QAT)."""
    return fuse_modules(model, modules_to_fuse, is_qat=True, inplace=inplace, fuser_func=fuser_func)
