"""The standard dtype configs (torch.ao's native set) and the reference backend's choice of them.

Backends pick from these when calling the builders in :mod:`qplug_core.config.common_patterns`;
a backend that needs other constraints (fbgemm's reduced activation range, say) builds its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qplug_core.config import DTypeConfig

if TYPE_CHECKING:
    from qplug_core.config import BackendPatternConfig

__all__ = [
    "DTypeConfigSet",
    "default_dynamic_float16_dtype_config",
    "default_dynamic_int8_dtype_config",
    "default_op_quint8_dtype_config",
    "input_output_only_quint8_dtype_config",
    "reference_dtype_configs",
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


@dataclass(frozen=True)
class DTypeConfigSet:
    """The dtype configs a backend supports for each family of the shared pattern set.

    A family claims what it is given and nothing else: a backend setting ``weighted_op`` and
    ``default_op`` declares no embedding, dynamic, recurrent or layer-norm pattern it has no
    kernel for (those patterns keep no dtype config, so their ops stay float). :meth:`native` is
    torch's native set (static quint8/qint8, dynamic int8 and float16 for linear and RNNs, quint8
    weight-only embeddings, quantized in/out layer norm), which the reference and fbgemm backends
    run, with the fields given replaced. Fields left ``None`` follow another:
    ``fixed_qparams_op``, ``share_qparams_op``, ``tensor_info_op`` and ``binary_op`` follow
    ``default_op``; ``rnn_op`` follows ``dynamic``; ``linear`` is ``weighted_op + dynamic``.
    """

    weighted_op: tuple[DTypeConfig, ...] = ()
    default_op: tuple[DTypeConfig, ...] = ()
    dynamic: tuple[DTypeConfig, ...] = ()
    embedding: tuple[DTypeConfig, ...] = ()
    layer_norm: tuple[DTypeConfig, ...] = ()
    fixed_qparams_op: tuple[DTypeConfig, ...] | None = None
    share_qparams_op: tuple[DTypeConfig, ...] | None = None
    tensor_info_op: tuple[DTypeConfig, ...] | None = None
    binary_op: tuple[DTypeConfig, ...] | None = None
    rnn_op: tuple[DTypeConfig, ...] | None = None
    linear: tuple[DTypeConfig, ...] | None = None

    @classmethod
    def native(cls, **fields: tuple[DTypeConfig, ...] | None) -> DTypeConfigSet:
        """torch's native set with ``fields`` replaced (``native(dynamic=())`` drops dynamic)."""
        return cls(**{"weighted_op": (weighted_op_quint8_dtype_config,),
                      "default_op": (default_op_quint8_dtype_config,),
                      "dynamic": (default_dynamic_int8_dtype_config, default_dynamic_float16_dtype_config),
                      "embedding": (weight_only_quint8_dtype_config,),
                      "layer_norm": (input_output_only_quint8_dtype_config,), **fields})

    def builder_kwargs(self) -> dict[str, list[DTypeConfig]]:
        """Keyword arguments of :func:`~qplug_core.config.common_patterns.common_pattern_configs`."""
        default = list(self.default_op)

        def follow(field: tuple[DTypeConfig, ...] | None, fallback: list[DTypeConfig]) -> list[DTypeConfig]:
            return fallback if field is None else list(field)

        return {
            "weighted_op_dtype_configs": list(self.weighted_op),
            "linear_dtype_configs": follow(self.linear, [*self.weighted_op, *self.dynamic]),
            "default_op_dtype_configs": default,
            "binary_op_dtype_configs": follow(self.binary_op, default),
            "fixed_qparams_op_dtype_configs": follow(self.fixed_qparams_op, default),
            "share_qparams_op_dtype_configs": follow(self.share_qparams_op, default),
            "tensor_info_op_dtype_configs": follow(self.tensor_info_op, default),
            "rnn_op_dtype_configs": follow(self.rnn_op, list(self.dynamic)),
            "embedding_op_dtype_configs": list(self.embedding),
            "layer_norm_op_dtype_configs": list(self.layer_norm),
        }

    def pattern_configs(self) -> list[BackendPatternConfig]:
        """The shared pattern set with these dtype configs (one config per pattern)."""
        from qplug_core.config.common_patterns import common_pattern_configs

        return common_pattern_configs(**self.builder_kwargs())


def reference_dtype_configs() -> dict[str, list[DTypeConfig]]:
    """Keyword arguments of :func:`~qplug_core.config.common_patterns.common_pattern_configs` for
    the core's reference backend: torch's native set (no 4-bit embeddings: the reference kernels
    do not pack quint4x2)."""
    return DTypeConfigSet.native().builder_kwargs()
