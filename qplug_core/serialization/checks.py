"""Checks of the values a loaded file supplies: qparams and layer tensor shapes.

A file is untrusted, so its numbers are checked before anything computes with them: a scale of
0, NaN or a denormal, a zero point outside the dtype, a ``quant_max`` beyond what the storage can
hold or a weight whose shape does not fit its layer would otherwise surface later as silent
garbage or a crash inside a kernel. Every error names the module field that is wrong.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qplug_core import qparams as Q
from qplug_core.config.codec import child
from qplug_core.errors import ConfigError
from qplug_core.kernels.reference import (
    DynamicQuantize,
    ReferenceRecurrent,
    ReferenceWeighted,
    _QParamsHolder,
    dynamic_weight_names,
)
from qplug_core.qparams import QParams

#: dtypes qparams may describe: the quantized ones, and float ones for float16 weight-only modules
_QPARAMS_DTYPES = (*Q.STORAGE_DTYPE, torch.float16, torch.bfloat16, torch.float32)
_SMALLEST_NORMAL = torch.finfo(torch.float32).tiny


def _fail(at: str, message: str, value: Any = None) -> None:
    raise ConfigError(f"{at}: {message}", field=at, value=value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_range(dtype: Any, quant_min: Any, quant_max: Any, at: str) -> None:
    """``quant_min <= quant_max``, both inside what ``dtype`` can hold."""
    if dtype not in _QPARAMS_DTYPES:
        _fail(child(at, "dtype"), f"{dtype!r} is not a quantized dtype (expected one of "
              f"{', '.join(map(str, _QPARAMS_DTYPES))})", dtype)
    if dtype not in Q.STORAGE_DTYPE:
        return
    low, high = Q.quant_range(dtype)
    for name, value in (("quant_min", quant_min), ("quant_max", quant_max)):
        if not _is_int(value) or not low <= value <= high:
            _fail(child(at, name), f"{value!r} is outside the range [{low}, {high}] of {dtype}", value)
    if quant_min > quant_max:
        _fail(child(at, "quant_min"), f"quant_min {quant_min} is above quant_max {quant_max}", quant_min)


def check_qparams(qparams: QParams, at: str) -> None:
    """Scales finite, positive and normal float32; zero points inside the dtype; shapes consistent."""
    check_range(qparams.dtype, qparams.quant_min, qparams.quant_max, at)
    scale, zero_point, axis = qparams.scale, qparams.zero_point, qparams.axis
    if scale.dtype != torch.float32:
        _fail(child(at, "scale"), f"scale is {scale.dtype}, expected torch.float32", str(scale.dtype))
    if axis is not None and (not _is_int(axis) or axis < 0):
        _fail(child(at, "axis"), f"axis {axis!r} is not a non-negative integer", axis)
    if axis is None and scale.numel() != 1:
        _fail(child(at, "scale"), f"a per-tensor scale has one element, not {scale.numel()}")
    if axis is not None and (scale.dim() != 1 or scale.numel() == 0):
        _fail(child(at, "scale"), f"a per-channel scale is a non-empty 1-d tensor, not shape "
              f"{tuple(scale.shape)}")
    if zero_point.shape != scale.shape:
        _fail(child(at, "zero_point"), f"zero_point has shape {tuple(zero_point.shape)} but scale has "
              f"{tuple(scale.shape)}")
    bad = ~torch.isfinite(scale) | (scale < _SMALLEST_NORMAL)
    if bool(bad.any()):
        value = float(scale.reshape(-1)[bad.reshape(-1)][0])
        _fail(child(at, "scale"), f"scale {value!r} is not a finite, positive, normal float32 (every scale "
              f"must be at least {_SMALLEST_NORMAL:.4g})", value)
    if zero_point.is_floating_point():  # per-row float qparams (embeddings): any finite offset
        if not bool(torch.isfinite(zero_point).all()):
            _fail(child(at, "zero_point"), "zero_point is not finite")
        return
    if zero_point.dtype != torch.int64:
        _fail(child(at, "zero_point"), f"zero_point is {zero_point.dtype}, expected torch.int64 (or a "
              "float dtype for per-row float qparams)", str(zero_point.dtype))
    if qparams.dtype in Q.STORAGE_DTYPE:
        low, high = Q.quant_range(qparams.dtype)
        outside = (zero_point < low) | (zero_point > high)
        if bool(outside.any()):
            value = int(zero_point.reshape(-1)[outside.reshape(-1)][0])
            _fail(child(at, "zero_point"), f"zero_point {value} is outside the range [{low}, {high}] of "
                  f"{qparams.dtype}", value)


def check_weight_qparams(qparams: QParams, shape: tuple[int, ...], at: str) -> None:
    """Per-channel weight qparams have one scale per channel of the weight along ``axis``."""
    if qparams.axis is None:
        return
    if qparams.axis >= len(shape) or shape[qparams.axis] != qparams.scale.numel():
        _fail(child(at, "axis"), f"per-channel qparams with {qparams.scale.numel()} channels along axis "
              f"{qparams.axis} do not fit a weight of shape {shape}", qparams.axis)


def _expected_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The tensor shapes torch's own layers imply by their size attributes."""
    if isinstance(module, nn.Linear):
        return {"weight": (module.out_features, module.in_features), "bias": (module.out_features,)}
    if isinstance(module, nn.modules.conv._ConvNd):
        inputs, outputs = module.in_channels, module.out_channels
        kernel = tuple(module.kernel_size)
        weight = (inputs, outputs // module.groups, *kernel) if module.transposed \
            else (outputs, inputs // module.groups, *kernel)
        return {"weight": weight, "bias": (outputs,)}
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return {"weight": (module.num_embeddings, module.embedding_dim)}
    if isinstance(module, nn.modules.batchnorm._NormBase):
        size = (module.num_features,)
        return {"weight": size, "bias": size, "running_mean": size, "running_var": size}
    return {}


def check_layer_shapes(module: nn.Module, at: str) -> None:
    try:
        expected_shapes = _expected_shapes(module)
    except (TypeError, AttributeError, ZeroDivisionError) as exc:
        raise ConfigError(f"{at}: the sizes of {type(module).__name__} are not valid: {exc}",
                          field=at) from exc
    for name, expected in expected_shapes.items():
        tensor = getattr(module, name, None)
        if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) != expected:
            _fail(child(at, name), f"{name} has shape {tuple(tensor.shape)} but {type(module).__name__} "
                  f"with these sizes needs {expected}", name)


def _check_recurrent_qparams(module: ReferenceRecurrent, at: str) -> None:
    """Each recorded qparams names a weight matrix of the layer and fits its shape: lowering packs
    that matrix with it."""
    names = dynamic_weight_names(module.module)
    for name, qparams in module.weight_qparams.items():
        name_at = child(child(at, "weight_qparams_holders"), name)
        if name not in names:
            _fail(name_at, f"{type(module.module).__name__} has no weight matrix {name!r} (it has "
                  f"{', '.join(names)})", name)
        check_weight_qparams(qparams, tuple(getattr(module.module, name).shape), name_at)


def check_loaded_values(root: nn.Module) -> None:
    """Check every module of a rebuilt model; raises :class:`ConfigError` naming the field."""
    for path, module in root.named_modules():
        at = f"modules[{path}]"
        if isinstance(module, _QParamsHolder):
            check_qparams(module.qparams, at)
        elif isinstance(module, DynamicQuantize):
            check_range(module.dtype, module.quant_min, module.quant_max, at)
        elif isinstance(module, ReferenceRecurrent):
            _check_recurrent_qparams(module, at)
        if not isinstance(module, ReferenceWeighted):
            check_layer_shapes(module, at)
