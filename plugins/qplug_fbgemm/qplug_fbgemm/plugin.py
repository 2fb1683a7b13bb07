"""Hook implementations of the ``fbgemm`` backend (entry point ``qplug: fbgemm``).

FBGEMM is the x86 int8 library behind ``torch.ops.quantized`` (engine ``fbgemm``). Its patterns are
the shared set with static quint8/qint8, dynamic int8 and float16, and 8-bit embeddings; its
kernels come from the core's torch.ops.quantized kernel table packed for this engine.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from qplug_core.backend import X86_MACHINES, Availability, BackendSpec, Diagnostic, engine_availability
from qplug_core.backend_configs import common_pattern_configs
from qplug_core.backend_configs import dtype_configs as dc
from qplug_core.hookspecs import hookimpl
from qplug_core.kernels.base import KernelSpec
from qplug_core.qconfig_defaults import default_qconfig_mapping

from qplug_fbgemm import cpu
from qplug_fbgemm.passes import limit_depthwise_input_range, warn_full_range_without_vnni

if TYPE_CHECKING:
    from qplug_core.config import BackendPatternConfig, QConfigMapping

NAME = "fbgemm"


def is_available() -> Availability:
    return engine_availability(NAME, machines=X86_MACHINES)


def reduce_range() -> bool:
    """7-bit activations ([0, 127]) unless the CPU has VNNI.

    Without VNNI, FBGEMM multiplies u8 activations by s8 weights with ``vpmaddubsw``, which adds
    adjacent products into int16 *with saturation*: 255 * 127 * 2 = 64,770 overflows 32,767 and the
    result is silently clipped. With activations in [0, 127] a pair sums to at most 32,512.
    VNNI (``vpdpbusd``) accumulates straight into int32, so the full 8-bit range is safe there.
    """
    return not cpu.has_vnni()


@functools.lru_cache(maxsize=None)
def _pattern_configs() -> tuple[BackendPatternConfig, ...]:
    static = [dc.weighted_op_quint8_dtype_config]
    dynamic = [dc.default_dynamic_int8_dtype_config, dc.default_dynamic_float16_dtype_config]
    default = [dc.default_op_quint8_dtype_config]
    return tuple(common_pattern_configs(
        weighted_op_dtype_configs=static, linear_dtype_configs=static + dynamic,
        default_op_dtype_configs=default, fixed_qparams_op_dtype_configs=default,
        share_qparams_op_dtype_configs=default, tensor_info_op_dtype_configs=default,
        rnn_op_dtype_configs=dynamic, embedding_op_dtype_configs=[dc.weight_only_quint8_dtype_config],
        layer_norm_op_dtype_configs=[dc.input_output_only_quint8_dtype_config]))


@hookimpl
def qplug_register_backends() -> list[BackendSpec]:
    return [BackendSpec(NAME, "x86 int8 kernels (FBGEMM: AVX2, AVX-512, VNNI)", engine=NAME,
                        is_available=is_available)]


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
    return default_qconfig_mapping(mode, reduce_range=reduce_range(), per_channel=True,
                                   per_channel_conv_transpose=False)


@hookimpl
def qplug_passes(stage: str, backend: str) -> list[Callable]:
    if backend == NAME and stage == "post_prepare":
        return [limit_depthwise_input_range, warn_full_range_without_vnni]
    return []


@hookimpl
def qplug_check_environment(backend: str) -> list[Diagnostic]:
    if backend != NAME:
        return []
    if cpu.has_vnni():
        return [Diagnostic("ok", "CPU has VNNI: 8-bit activations are safe with fbgemm")]
    return [Diagnostic("warning", "CPU lacks VNNI: fbgemm's int16 pair sums can saturate with 8-bit "
                                  "activations", hint="keep the plugin's default reduce_range=True")]
