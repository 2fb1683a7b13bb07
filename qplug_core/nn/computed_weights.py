"""Weights computed from other tensors (``torch.nn.utils.parametrize``, ``parametrizations.weight_norm``
and ``spectral_norm``, the older hook-based ``torch.nn.utils.weight_norm`` / ``spectral_norm``).

Such a ``weight`` is recomputed at every access (a parametrization) or reassigned before every call
(a forward pre-hook), so whatever is written into it (BatchNorm folded in, int8 rounding) is lost.
The inference flows therefore bake each into a plain ``Parameter`` on qplug's own copy of the model;
QAT keeps the tensors the weight is computed from trainable (the hooks become the equivalent
parametrizations, which QAT modules carry over) and convert then materialises the weight.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.nn.utils.spectral_norm import SpectralNorm, remove_spectral_norm
from torch.nn.utils.weight_norm import WeightNorm, remove_weight_norm

from qplug_core.errors import ModelStateError

__all__ = ["copy_model", "has_computed_weights", "without_computed_weights"]

_HOOKS = (WeightNorm, SpectralNorm)


def _parametrized(module: nn.Module) -> bool:
    return "parametrizations" in module._modules  # torch's is_parametrized raises inside for the others


def _hooks(module: nn.Module) -> list[WeightNorm | SpectralNorm]:
    return [hook for hook in module._forward_pre_hooks.values() if isinstance(hook, _HOOKS)]


def has_computed_weights(model: nn.Module) -> bool:
    """Whether any module of ``model`` has a parametrized tensor or a weight_norm/spectral_norm hook."""
    return any(_parametrized(m) or _hooks(m) for m in model.modules())


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, also of old-style weight_norm/spectral_norm modules: their computed
    ``weight`` is a non-leaf tensor, which deepcopy refuses; the copy gets it detached (its hook
    recomputes it at the next call anyway)."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for hook in _hooks(module):
            weight = getattr(module, hook.name)
            memo[id(weight)] = weight.detach().clone()
    return copy.deepcopy(model, memo)


def without_computed_weights(model: nn.Module, *, inplace: bool,
                             trainable: bool = False) -> tuple[nn.Module, bool]:
    """``model`` with every computed weight baked into a plain ``Parameter`` (``trainable``: the
    hooks turned into parametrizations instead, so that QAT trains what the weight is computed
    from); a copy unless ``inplace``. Returns the model and whether the caller may now change it in
    place (True once it is qplug's copy). A model without computed weights is returned as it is."""
    if not has_computed_weights(model):
        return model, inplace
    model = model if inplace else copy_model(model)
    for name, module in model.named_modules():
        for hook in _hooks(module):
            _replace_hook(name, module, hook, trainable)
        if not trainable and _parametrized(module):
            _bake_parametrizations(name, module)
    return model, True


def _replace_hook(layer: str, module: nn.Module, hook: WeightNorm | SpectralNorm, trainable: bool) -> None:
    if isinstance(hook, WeightNorm):
        g, v = (getattr(module, hook.name + suffix).detach() for suffix in ("_g", "_v"))
        remove_weight_norm(module, hook.name)  # the weight the hook computes, as a Parameter
        if trainable:
            parametrizations.weight_norm(module, hook.name, hook.dim)
            _set_originals(module.parametrizations[hook.name], original0=g, original1=v)
        return
    orig, u, v = (getattr(module, hook.name + suffix).detach() for suffix in ("_orig", "_u", "_v"))
    remove_spectral_norm(module, hook.name)  # weight / sigma, without a power iteration
    if trainable:
        if orig.ndim < 2:
            raise ModelStateError(f"layer {layer!r}: its hook-based spectral_norm normalises a "
                                  f"{orig.ndim}-D {hook.name!r}, which QAT cannot train through; "
                                  "apply torch.nn.utils.parametrizations.spectral_norm instead")
        parametrizations.spectral_norm(module, hook.name, hook.n_power_iterations, hook.eps, hook.dim)
        parametrization = module.parametrizations[hook.name]
        _set_originals(parametrization, original=orig)
        _set_originals(parametrization[0], _u=u, _v=v)


def _set_originals(owner: nn.Module, **tensors: torch.Tensor) -> None:
    with torch.no_grad():
        for name, value in tensors.items():
            getattr(owner, name).copy_(value)


def _bake_parametrizations(layer: str, module: nn.Module) -> None:
    """Each parametrized tensor as its eval-mode value. Not ``remove_parametrizations``: it deletes the
    property from the parametrized class, which a deep copy shares with the user's module."""
    parametrizations_ = module.parametrizations
    parametrizations_.eval()  # spectral_norm iterates in train mode: bake what inference uses
    values = {}
    with torch.no_grad():
        for tensor_name, parametrization in parametrizations_.items():
            try:
                values[tensor_name] = getattr(module, tensor_name)
            except Exception as e:
                kinds = ", ".join(type(p).__name__ for p in parametrization)
                raise ModelStateError(
                    f"layer {layer!r}: its parametrized {tensor_name!r} ({kinds}) cannot be computed "
                    f"in eval mode to quantize it ({type(e).__name__}: {e}); remove the parametrization "
                    f"with torch.nn.utils.parametrize.remove_parametrizations(module, {tensor_name!r}) "
                    "before quantizing") from e
    module.__class__ = parametrize.type_before_parametrizations(module)
    del module._modules["parametrizations"]
    for tensor_name, value in values.items():
        originals = list(parametrizations_[tensor_name].parameters(recurse=False))
        if originals:
            module.register_parameter(tensor_name, nn.Parameter(
                value, requires_grad=any(o.requires_grad for o in originals)))
        else:
            module.register_buffer(tensor_name, value)
