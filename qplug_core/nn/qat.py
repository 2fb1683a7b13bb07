"""QAT modules: float modules whose weights pass through a fake quant while training.

``prepare_qat`` swaps each float (or fused float) module for the class here whose
``FLOAT_MODULE`` is its type, via ``from_float(mod, qconfig)``; ``to_float()`` goes back (with
BatchNorm folded in). The classes live in ``qat_conv``, ``qat_linear`` and ``qat_embedding``; this
module is their public namespace, like ``torch.ao.nn.qat`` + ``torch.ao.nn.intrinsic.qat``.
"""

from __future__ import annotations

from qplug_core.nn.qat_base import QATModule, QATWithBn, freeze_bn_stats, update_bn_stats
from qplug_core.nn.qat_conv import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvBn1d,
    ConvBn2d,
    ConvBn3d,
    ConvBnReLU1d,
    ConvBnReLU2d,
    ConvBnReLU3d,
    ConvReLU1d,
    ConvReLU2d,
    ConvReLU3d,
)
from qplug_core.nn.qat_embedding import Embedding, EmbeddingBag
from qplug_core.nn.qat_linear import Linear, LinearBn1d, LinearBnReLU1d, LinearReLU

__all__ = [
    "Conv1d", "Conv2d", "Conv3d",
    "ConvBn1d", "ConvBn2d", "ConvBn3d",
    "ConvBnReLU1d", "ConvBnReLU2d", "ConvBnReLU3d",
    "ConvReLU1d", "ConvReLU2d", "ConvReLU3d",
    "Embedding", "EmbeddingBag",
    "Linear", "LinearBn1d", "LinearBnReLU1d", "LinearReLU",
    "QATModule", "QATWithBn",
    "freeze_bn_stats", "update_bn_stats",
]
