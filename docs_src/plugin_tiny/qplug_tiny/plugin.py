"""Hook implementations of the ``tiny`` backend (entry point ``qplug: tiny``)."""

from __future__ import annotations

import torch
from torch import nn

from qplug_core.backend import BackendSpec, Diagnostic, engine_availability
from qplug_core.config import BackendPatternConfig, DTypeConfig, QConfigMapping
from qplug_core.hookspecs import hookimpl
from qplug_core.kernels import KernelSpec
from qplug_core.kernels import torch_int8 as K
from qplug_core.qconfig_defaults import default_qconfig_mapping

NAME = "tiny"
ENGINE = "qnnpack"  # the torch.backends.quantized engine our kernels pack weights for

# What the kernel accepts: quint8 activations in and out, qint8 weights, float bias.
LINEAR_INT8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8,
                          weight_dtype=torch.qint8, bias_dtype=torch.float)


def is_available():
    return engine_availability(ENGINE)


@hookimpl
def qplug_register_backends() -> list[BackendSpec]:
    return [BackendSpec(NAME, "int8 nn.Linear only (docs tutorial)", engine=ENGINE,
                        is_available=is_available)]


@hookimpl
def qplug_backend_pattern_configs(backend: str) -> list[BackendPatternConfig]:
    if backend != NAME:
        return []
    return [BackendPatternConfig(nn.Linear).add_dtype_config(LINEAR_INT8)
            .set_root_module(nn.Linear)]


@hookimpl
def qplug_int8_kernels(backend: str) -> dict:
    if backend != NAME:
        return {}
    return {
        # the pattern key is the complex format of the pattern config above
        nn.Linear: KernelSpec("quantized::linear", build=K.Linear.from_context,
                              self_test=lambda: K.Linear.self_test(ENGINE)),
        # boundary modules: float -> the engine's quantized tensors, and back
        "quantize": KernelSpec("quantize_per_tensor", build=K.Quantize.from_context),
        "dequantize": KernelSpec("dequantize", build=K.Dequantize.from_context),
    }


@hookimpl
def qplug_default_qconfig_mapping(backend: str, mode: str) -> QConfigMapping | None:
    if backend != NAME or mode != "static":
        return None
    # qnnpack wants weights in [-127, 127]; per-tensor weights keep the example small
    return default_qconfig_mapping("static", per_channel=False, weight_quant_min=-127)


@hookimpl
def qplug_check_environment(backend: str) -> list[Diagnostic]:
    if backend != NAME:
        return []
    found = is_available()
    if found.ok:
        return [Diagnostic("ok", f"engine {ENGINE!r} is available")]
    return [Diagnostic("error", found.reason, hint="use the reference backend instead")]
