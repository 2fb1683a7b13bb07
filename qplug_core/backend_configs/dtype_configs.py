"""The standard dtype configs (torch.ao's native set) and the reference backend's choice of them.

Backends pick from these when calling the builders in :mod:`qplug_core.backend_configs.common`;
a backend that needs other constraints (fbgemm's reduced activation range, say) builds its own.
"""

from __future__ import annotations

import torch

from qplug_core.config import DTypeConfig

__all__ = [
    "default_dynamic_float16_dtype_config",
    "default_dynamic_int8_dtype_config",
    "default_op_quint8_dtype_config",
    "input_output_only_quint8_dtype_config",
    "reference_dtype_configs",
    "weight_only_quint4x2_dtype_config",
    "weight_only_quint8_dtype_config",
    "weighted_op_quint8_dtype_config",
]

weighted_op_quint8_dtype_config = DTypeConfig(
    input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.qint8,
    bias_dtype=torch.float)
"""Static int8 conv/linear: quint8 activations, qint8 weights, float bias."""

default_op_quint8_dtype_config = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8)
"""Static ops without weights (add, pooling, activations)."""

default_dynamic_int8_dtype_config = DTypeConfig(
    input_dtype=torch.quint8, output_dtype=torch.float, weight_dtype=torch.qint8,
    bias_dtype=torch.float, is_dynamic=True)
"""Dynamic quantization: qint8 weights ahead of time, activations quantized per call."""

default_dynamic_float16_dtype_config = DTypeConfig(
    input_dtype=torch.float16, output_dtype=torch.float, weight_dtype=torch.float16,
    bias_dtype=torch.float, is_dynamic=True)
"""Dynamic float16: weights stored in half precision."""

input_output_only_quint8_dtype_config = DTypeConfig(
    input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.float,
    bias_dtype=torch.float)
"""Quantized in/out with float affine params (layer norm kernels take float weights)."""

weight_only_quint8_dtype_config = DTypeConfig(
    input_dtype=torch.float, output_dtype=torch.float, weight_dtype=torch.quint8)
"""Weight-only quantization (embedding tables)."""

weight_only_quint4x2_dtype_config = DTypeConfig(
    input_dtype=torch.float, output_dtype=torch.float, weight_dtype=torch.quint4x2)
"""4-bit weight-only embedding tables (two values per byte)."""


def reference_dtype_configs() -> dict[str, list[DTypeConfig]]:
    """Keyword arguments of :func:`~qplug_core.backend_configs.common.common_pattern_configs` for
    the core's reference backend: static quint8/qint8, dynamic int8 and float16 for linear and
    RNNs, quint8 weight-only embeddings (no 4-bit: the reference kernels do not pack quint4x2)."""
    static = [weighted_op_quint8_dtype_config]
    dynamic = [default_dynamic_int8_dtype_config, default_dynamic_float16_dtype_config]
    default = [default_op_quint8_dtype_config]
    return {
        "weighted_op_dtype_configs": static,
        "linear_dtype_configs": static + dynamic,
        "default_op_dtype_configs": default,
        "fixed_qparams_op_dtype_configs": default,
        "share_qparams_op_dtype_configs": default,
        "tensor_info_op_dtype_configs": default,
        "rnn_op_dtype_configs": dynamic,
        "embedding_op_dtype_configs": [weight_only_quint8_dtype_config],
        "layer_norm_op_dtype_configs": [input_output_only_quint8_dtype_config],
    }
