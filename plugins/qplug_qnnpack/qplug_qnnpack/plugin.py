"""The ``qnnpack`` backend (entry point ``qplug: qnnpack = qplug_qnnpack.plugin:plugin``).

QNNPACK/XNNPACK kernels (engine ``qnnpack``) are built for ARM first. They need symmetric qint8
weights in [-127, 127] (so that -w is representable in the kernels' int8 paths) and scales of at
least 2^-12 (their fixed-point requantization loses precision below that), and they have no
float16 dynamic linear. The dtype configs state exactly that, so prepare refuses qconfigs these
kernels cannot honour instead of producing wrong numbers.
"""

from __future__ import annotations

import torch

from qplug_core.plugin_api import (
    ARM_MACHINES,
    BackendPlugin,
    DTypeConfig,
    DTypeConfigSet,
    Int8Arithmetic,
    default_op_quint8_dtype_config,
    weight_only_quint8_dtype_config,
)
from qplug_core.plugin_api import DTypeWithConstraints as Constrained

MIN_SCALE = 2.0 ** -12
WEIGHT_RANGE = (-127, 127)

_activation = Constrained(dtype=torch.quint8, scale_min_lower_bound=MIN_SCALE)
_weight = Constrained(dtype=torch.qint8, quant_min_lower_bound=WEIGHT_RANGE[0],
                      quant_max_upper_bound=WEIGHT_RANGE[1], scale_min_lower_bound=MIN_SCALE)


# DTypeConfig(input, output, weight, bias): activations in and out, weight, bias
class QnnpackPlugin(BackendPlugin):
    name = engine = "qnnpack"
    description = "ARM-first int8 kernels (QNNPACK/XNNPACK), also built for x86"
    preferred_machines = ARM_MACHINES
    #: widening multiplies into int32 (NEON; SSE2 pmaddwd on x86): full 8 bits on any CPU
    int8_arithmetic = Int8Arithmetic.INT32
    dtype_configs = DTypeConfigSet(
        weighted_op=(DTypeConfig(_activation, _activation, _weight, torch.float),),
        default_op=(DTypeConfig(_activation, _activation),),
        dynamic=(DTypeConfig(torch.quint8, torch.float, _weight, torch.float, is_dynamic=True),),
        layer_norm=(DTypeConfig(_activation, _activation, torch.float, torch.float),),
        embedding=(weight_only_quint8_dtype_config,),
        # fixed-qparams ops carry their own exact scale (1/256 or 2/256), above the bound anyway
        fixed_qparams_op=(default_op_quint8_dtype_config,))

    def qconfig_options(self, mode: str) -> dict:
        # per-channel transposed convs where torch has them: the default mapping gives grouped
        # ones per-tensor weights (``grouped_transpose_qconfig``), else they would stay float
        return {"reduce_range": False, "per_channel": True, "per_channel_conv_transpose": True,
                "weight_quant_min": WEIGHT_RANGE[0], "weight_quant_max": WEIGHT_RANGE[1],
                "eps": MIN_SCALE}


plugin = QnnpackPlugin()
