"""QAT linear modules: Linear, LinearReLU, LinearBn1d and LinearBnReLU1d."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.nn import intrinsic as nni
from qplug_core.nn.qat_base import QATModule, QATWithBn

__all__ = ["Linear", "LinearBn1d", "LinearBnReLU1d", "LinearReLU"]


class Linear(QATModule, nn.Linear):
    """QAT Linear: ``F.linear`` with a fake-quantized weight."""

    FLOAT_MODULE = nn.Linear
    FLOAT_ROOT = nn.Linear
    FUSED_FLOAT = nni.LinearReLU

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 qconfig: Any = None, device: Any = None, dtype: Any = None):
        nn.Linear.__init__(self, in_features, out_features, bias, device=device, dtype=dtype)
        self._init_fake_quant(qconfig)

    @staticmethod
    def _root_args(root: nn.Module) -> dict[str, Any]:
        return {"in_features": root.in_features, "out_features": root.out_features,
                "bias": root.bias is not None}

    def _apply_weight(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class LinearReLU(Linear):
    """QAT LinearReLU: ``relu(linear)`` with a fake-quantized weight."""

    FLOAT_MODULE = nni.LinearReLU
    WITH_RELU = True


class LinearBn1d(QATWithBn, Linear):
    """QAT LinearBn1d: Linear + BatchNorm1d trained with BN statistics (see :class:`QATWithBn`)."""

    FLOAT_MODULE = nni.LinearBn1d
    BN_CLASS = nn.BatchNorm1d

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 eps: float = 1e-5, momentum: float | None = 0.1, freeze_bn: bool = False, *,
                 qconfig: Any = None, device: Any = None, dtype: Any = None):
        Linear.__init__(self, in_features, out_features, bias, qconfig=qconfig, device=device,
                        dtype=dtype)
        self._init_bn(out_features, eps, momentum, freeze_bn, device, dtype)


class LinearBnReLU1d(LinearBn1d):
    """QAT LinearBnReLU1d: relu(bn(linear)) trained with BN statistics; torch.ao has no such module,
    but the fusion it is prepared from exists, so a tabular MLP block trains and lowers as one layer."""

    FLOAT_MODULE = nni.LinearBnReLU1d
    WITH_RELU = True
