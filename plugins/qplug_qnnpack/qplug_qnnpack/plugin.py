"""Hook implementations of the ``qnnpack`` backend (entry point ``qplug: qnnpack``).

QNNPACK/XNNPACK kernels (engine ``qnnpack``) are built for ARM first. They need symmetric qint8
weights in [-127, 127] (so that -w is representable in the kernels' int8 paths) and scales of at
least 2^-12 (their fixed-point requantization loses precision below that), and they quantize the
bias to int32. They have no float16 dynamic linear. The dtype configs below state exactly that, so
prepare refuses qconfigs these kernels cannot honour instead of producing wrong numbers.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from qplug_core.backend import Availability, BackendSpec, engine_availability
from qplug_core.backend_configs import common_pattern_configs
from qplug_core.backend_configs import dtype_configs as dc
from qplug_core.config import DTypeConfig, DTypeWithConstraints
from qplug_core.hookspecs import hookimpl
from qplug_core.kernels.base import KernelSpec
from qplug_core.qconfig_defaults import default_qconfig_mapping

if TYPE_CHECKING:
    from qplug_core.config import BackendPatternConfig, QConfigMapping

NAME = "qnnpack"
MIN_SCALE = 2.0 ** -12
WEIGHT_RANGE = (-127, 127)

_activation = DTypeWithConstraints(dtype=torch.quint8, scale_min_lower_bound=MIN_SCALE)
_weight = DTypeWithConstraints(dtype=torch.qint8, quant_min_lower_bound=WEIGHT_RANGE[0],
                               quant_max_upper_bound=WEIGHT_RANGE[1], scale_min_lower_bound=MIN_SCALE)
weighted_op_dtype_config = DTypeConfig(input_dtype=_activation, output_dtype=_activation,
                                       weight_dtype=_weight, bias_dtype=torch.float)
default_op_dtype_config = DTypeConfig(input_dtype=_activation, output_dtype=_activation)
dynamic_int8_dtype_config = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.float,
                                        weight_dtype=_weight, bias_dtype=torch.float, is_dynamic=True)
layer_norm_dtype_config = DTypeConfig(input_dtype=_activation, output_dtype=_activation,
                                      weight_dtype=torch.float, bias_dtype=torch.float)


def is_available() -> Availability:
    return engine_availability(NAME)


@functools.lru_cache(maxsize=None)
def _pattern_configs() -> tuple[BackendPatternConfig, ...]:
    static, default = [weighted_op_dtype_config], [default_op_dtype_config]
    return tuple(common_pattern_configs(
        weighted_op_dtype_configs=static, linear_dtype_configs=static + [dynamic_int8_dtype_config],
        default_op_dtype_configs=default,
        # fixed-qparams ops carry their own exact scale (1/256 or 2/256), above the bound anyway
        fixed_qparams_op_dtype_configs=[dc.default_op_quint8_dtype_config],
        share_qparams_op_dtype_configs=default, tensor_info_op_dtype_configs=default,
        rnn_op_dtype_configs=[dynamic_int8_dtype_config],
        embedding_op_dtype_configs=[dc.weight_only_quint8_dtype_config],
        layer_norm_op_dtype_configs=[layer_norm_dtype_config]))


@hookimpl
def qplug_register_backends() -> list[BackendSpec]:
    return [BackendSpec(NAME, "ARM-first int8 kernels (QNNPACK/XNNPACK), also built for x86",
                        engine=NAME, is_available=is_available)]


@hookimpl
def qplug_backend_pattern_configs(backend: str) -> list[BackendPatternConfig]:
    return list(_pattern_configs()) if backend == NAME else []


@hookimpl
def qplug_int8_kernels(backend: str) -> dict[Any, KernelSpec]:
    if backend != NAME:
        return {}
    from qplug_core.kernels.table import torch_int8_kernels

    return torch_int8_kernels((c.pattern_complex_format for c in _pattern_configs()), NAME)


@hookimpl
def qplug_default_qconfig_mapping(backend: str, mode: str) -> QConfigMapping | None:
    if backend != NAME:
        return None
    return default_qconfig_mapping(mode, reduce_range=False, per_channel=True,
                                   per_channel_conv_transpose=True,
                                   weight_quant_min=WEIGHT_RANGE[0], weight_quant_max=WEIGHT_RANGE[1],
                                   eps=MIN_SCALE)
