"""Fuser methods: build one fused module from the modules a fusion pattern matched.

Every fuser has the signature ``fuser(is_qat, *modules_in_forward_order) -> nn.Module``. With
``is_qat=False`` (post-training fusion of an eval model) BatchNorm is folded into the weights; with
``is_qat=True`` it is kept in a ``ConvBn*`` / ``LinearBn1d`` container so that prepare_qat can swap
in a QAT module that still trains BN. Activations given as functions (``F.relu``, ``torch.relu``,
``"relu"``) are accepted and turned into ``nn.ReLU`` modules, because an FX match hands the fuser a
function where the user wrote one. All fusers are module-level functions so configs can name them
by dotted path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrize import type_before_parametrizations

from qplug_core.errors import ConfigValidationError, PatternError
from qplug_core.nn import intrinsic as nni
from qplug_core.nn.folding import fold_bn_into_conv, fold_bn_into_linear

__all__ = [
    "DEFAULT_FUSER_METHODS",
    "FuserMethod",
    "fuse_bn_relu",
    "fuse_conv_add",
    "fuse_conv_add_relu",
    "fuse_conv_bn",
    "fuse_conv_bn_add",
    "fuse_conv_bn_add_relu",
    "fuse_conv_bn_relu",
    "fuse_conv_relu",
    "fuse_convtranspose_bn",
    "fuse_linear_bn",
    "fuse_linear_bn_relu",
    "fuse_linear_relu",
    "get_fuser_method",
]

FuserMethod = Callable[..., nn.Module]

_DIMS = (1, 2, 3)
_CONVT_BY_DIM: dict[int, type[nn.Module]] = {
    1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_CONV_RELU = {nni.CONV_BY_DIM[d]: cls for d, cls in zip(_DIMS, (nni.ConvReLU1d, nni.ConvReLU2d, nni.ConvReLU3d))}
_CONV_BN = {nni.CONV_BY_DIM[d]: cls for d, cls in zip(_DIMS, (nni.ConvBn1d, nni.ConvBn2d, nni.ConvBn3d))}
_CONV_BN_RELU = {nni.CONV_BY_DIM[d]: cls
                 for d, cls in zip(_DIMS, (nni.ConvBnReLU1d, nni.ConvBnReLU2d, nni.ConvBnReLU3d))}
_BN_RELU = {nn.BatchNorm2d: nni.BNReLU2d, nn.BatchNorm3d: nni.BNReLU3d}
_RELU_FUNCTIONS: tuple[Any, ...] = (F.relu, torch.relu, "relu")


def _fused_class(table: dict[type, type[nn.Module]], root: nn.Module, what: str) -> type[nn.Module]:
    cls = table.get(type_before_parametrizations(root))
    if cls is None:
        names = ", ".join(t.__name__ for t in table)
        raise ConfigValidationError(f"Cannot fuse {what}: {type(root).__name__} is not one of {names}",
                                    field=what, value=type(root))
    return cls


def _as_relu(relu: Any, root: nn.Module) -> nn.Module:
    """An ``nn.ReLU`` for a matched relu, whether it was a module or a function call."""
    if isinstance(relu, nn.Module):
        return relu
    if any(relu is f for f in _RELU_FUNCTIONS):
        module = nn.ReLU()
        module.train(root.training)
        return module
    raise ConfigValidationError(f"Expected a ReLU module or relu function, got {relu!r}",
                                field="relu", value=relu)


def _check_qat_bn(bn: nn.Module, out_channels: int, root: nn.Module) -> None:
    """The QAT BN modules rebuild BN as affine with running stats and the root's channel count."""
    if bn.num_features != out_channels:
        raise ConfigValidationError(
            f"{type(bn).__name__} has {bn.num_features} features but {type(root).__name__} has "
            f"{out_channels} output channels", field="num_features", value=bn.num_features)
    if not bn.affine or not bn.track_running_stats:
        raise ConfigValidationError(
            f"QAT fusion needs {type(bn).__name__}(affine=True, track_running_stats=True)",
            field="affine" if not bn.affine else "track_running_stats", value=False)


# -- conv ------------------------------------------------------------------------------------------


def fuse_conv_bn(is_qat: bool, conv: nn.Module, bn: nn.Module) -> nn.Module:
    """QAT: ``ConvBn{1,2,3}d(conv, bn)``; eval: a conv with the BN folded into its weights."""
    if is_qat:
        cls = _fused_class(_CONV_BN, conv, "conv")
        _check_qat_bn(bn, conv.out_channels, conv)
        return cls(conv, bn)
    return fold_bn_into_conv(conv, bn)


def fuse_conv_bn_relu(is_qat: bool, conv: nn.Module, bn: nn.Module, relu: Any) -> nn.Module:
    """QAT: ``ConvBnReLU{1,2,3}d``; eval: ``ConvReLU{1,2,3}d`` around the BN-folded conv."""
    relu = _as_relu(relu, conv)
    if is_qat:
        cls = _fused_class(_CONV_BN_RELU, conv, "conv")
        _check_qat_bn(bn, conv.out_channels, conv)
        return cls(conv, bn, relu)
    cls = _fused_class(_CONV_RELU, conv, "conv")
    return cls(fold_bn_into_conv(conv, bn), relu)


def fuse_conv_relu(is_qat: bool, conv: nn.Module, relu: Any) -> nn.Module:
    """``ConvReLU{1,2,3}d(conv, relu)`` in both modes (nothing to fold)."""
    return _fused_class(_CONV_RELU, conv, "conv")(conv, _as_relu(relu, conv))


def fuse_convtranspose_bn(is_qat: bool, convt: nn.Module, bn: nn.Module) -> nn.Module:
    """Eval only: a conv transpose with the BN folded in (there is no QAT ConvTransposeBn module)."""
    if is_qat:
        raise ConfigValidationError(
            f"Fusing {type(convt).__name__} + {type(bn).__name__} is not supported for QAT; "
            "leave them unfused for prepare_qat, or fuse the eval model with fuse_fx",
            field="is_qat", value=True)
    return fold_bn_into_conv(convt, bn)


def fuse_conv_add(is_qat: bool, conv: nn.Module, add: Callable[..., Any]) -> nn.Module:
    """``ConvAdd2d``: conv whose output is added to an extra input (the residual)."""
    return nni.ConvAdd2d(conv, add)


def fuse_conv_add_relu(is_qat: bool, conv: nn.Module, add: Callable[..., Any], relu: Any) -> nn.Module:
    """``ConvAddReLU2d``: relu(conv(x) + residual)."""
    return nni.ConvAddReLU2d(conv, add, _as_relu(relu, conv))


def _eval_only(is_qat: bool, modules: tuple[nn.Module, ...]) -> None:
    if is_qat:
        names = " + ".join(type(m).__name__ if isinstance(m, nn.Module) else repr(m) for m in modules)
        raise ConfigValidationError(
            f"Fusing {names} is not supported for QAT (no QAT module keeps BN before an add); "
            "leave it unfused for prepare_qat", field="is_qat", value=True)


def fuse_conv_bn_add(is_qat: bool, conv: nn.Module, bn: nn.Module,
                     add: Callable[..., Any]) -> nn.Module:
    """Eval only: ``ConvAdd2d`` around the BN-folded conv."""
    _eval_only(is_qat, (conv, bn, add))
    return nni.ConvAdd2d(fold_bn_into_conv(conv, bn), add)


def fuse_conv_bn_add_relu(is_qat: bool, conv: nn.Module, bn: nn.Module,
                          add: Callable[..., Any], relu: Any) -> nn.Module:
    """Eval only: ``ConvAddReLU2d`` around the BN-folded conv."""
    _eval_only(is_qat, (conv, bn, add, relu))
    return nni.ConvAddReLU2d(fold_bn_into_conv(conv, bn), add, _as_relu(relu, conv))


# -- linear and bn ---------------------------------------------------------------------------------


def fuse_linear_bn(is_qat: bool, linear: nn.Module, bn: nn.Module) -> nn.Module:
    """QAT: ``LinearBn1d(linear, bn)``; eval: a Linear with the BN folded into its weights."""
    if is_qat:
        _check_qat_bn(bn, linear.out_features, linear)
        return nni.LinearBn1d(linear, bn)
    return fold_bn_into_linear(linear, bn)


def fuse_linear_bn_relu(is_qat: bool, linear: nn.Module, bn: nn.Module, relu: Any) -> nn.Module:
    """QAT: ``LinearBnReLU1d``; eval: ``LinearReLU`` around the BN-folded Linear (one int8 kernel:
    left as Linear + ReLU after the fold, the pair matched no fusion and no kernel)."""
    relu = _as_relu(relu, linear)
    if is_qat:
        _check_qat_bn(bn, linear.out_features, linear)
        return nni.LinearBnReLU1d(linear, bn, relu)
    return nni.LinearReLU(fold_bn_into_linear(linear, bn), relu)


def fuse_linear_relu(is_qat: bool, linear: nn.Module, relu: Any) -> nn.Module:
    """``LinearReLU(linear, relu)`` in both modes."""
    return nni.LinearReLU(linear, _as_relu(relu, linear))


def fuse_bn_relu(is_qat: bool, bn: nn.Module, relu: Any) -> nn.Module:
    """``BNReLU{2,3}d(bn, relu)`` in both modes (the int8 kernel runs BN and relu together)."""
    return _fused_class(_BN_RELU, bn, "bn")(bn, _as_relu(relu, bn))


# -- lookup ----------------------------------------------------------------------------------------


def _default_fuser_methods() -> dict[tuple[type[nn.Module], ...], FuserMethod]:
    table: dict[tuple[type[nn.Module], ...], FuserMethod] = {}
    for d in _DIMS:
        conv, bn = nni.CONV_BY_DIM[d], nni.BN_BY_DIM[d]
        table[(conv, bn)] = fuse_conv_bn
        table[(conv, bn, nn.ReLU)] = fuse_conv_bn_relu
        table[(conv, nn.ReLU)] = fuse_conv_relu
    table[(nn.Linear, nn.BatchNorm1d)] = fuse_linear_bn
    table[(nn.Linear, nn.ReLU)] = fuse_linear_relu
    for bn_type in _BN_RELU:
        table[(bn_type, nn.ReLU)] = fuse_bn_relu
    for d in _DIMS:
        table[(_CONVT_BY_DIM[d], nni.BN_BY_DIM[d])] = fuse_convtranspose_bn
    return table


DEFAULT_FUSER_METHODS: dict[tuple[type[nn.Module], ...], FuserMethod] = _default_fuser_methods()
"""Module-type sequences (forward order) that eager ``fuse_modules`` can fuse, and how."""


def get_fuser_method(
    op_types: tuple[type[nn.Module], ...],
    additional: dict[tuple[type[nn.Module], ...], FuserMethod] | None = None,
) -> FuserMethod:
    """The fuser for a forward-order tuple of module types; ``additional`` entries take precedence."""
    table = {**DEFAULT_FUSER_METHODS, **(additional or {})}
    fuser = table.get(tuple(op_types))
    if fuser is None:
        names = ", ".join(getattr(t, "__name__", repr(t)) for t in op_types)
        known = "; ".join("(" + ", ".join(t.__name__ for t in key) + ")" for key in table)
        raise PatternError(f"No fuser method for ({names}). Known sequences: {known}. Pass a "
                           "custom fuser for other sequences", pattern=tuple(op_types))
    return fuser
