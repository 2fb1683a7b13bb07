"""Building blocks for backend configs: the shared pattern configs and standard dtype configs.

A backend plugin typically writes::

    from qplug_core.backend_configs import common_pattern_configs, dtype_configs as dc
    configs = common_pattern_configs(weighted_op_dtype_configs=[dc.weighted_op_quint8_dtype_config], ...)
"""

from __future__ import annotations

from qplug_core.backend_configs import dtype_configs
from qplug_core.backend_configs.common import (
    FIXED_QPARAMS_CONSTRAINTS,
    binary_op_configs,
    bn_configs,
    cat_config,
    common_pattern_configs,
    conv_configs,
    default_op_configs,
    embedding_op_configs,
    fixed_qparams_dtype_configs,
    fixed_qparams_op_configs,
    linear_configs,
    ln_configs,
    rnn_op_configs,
    share_qparams_op_configs,
    tensor_info_op_configs,
)
from qplug_core.backend_configs.dtype_configs import reference_dtype_configs

__all__ = [
    "FIXED_QPARAMS_CONSTRAINTS",
    "binary_op_configs",
    "bn_configs",
    "cat_config",
    "common_pattern_configs",
    "conv_configs",
    "default_op_configs",
    "dtype_configs",
    "embedding_op_configs",
    "fixed_qparams_dtype_configs",
    "fixed_qparams_op_configs",
    "linear_configs",
    "ln_configs",
    "reference_dtype_configs",
    "rnn_op_configs",
    "share_qparams_op_configs",
    "tensor_info_op_configs",
]
