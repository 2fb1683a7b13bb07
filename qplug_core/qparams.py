"""Quantization parameters and the affine quantization maths on plain tensors.

Quantized values are stored in ordinary integer tensors (``torch.uint8`` for quint8, ``torch.int8``
for qint8, ``torch.int32`` for qint32) so that the core never creates deprecated torch quantized
tensors; only backend kernels do, inside their own modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: storage dtype of each quantized dtype identifier
STORAGE_DTYPE = {torch.quint8: torch.uint8, torch.qint8: torch.int8, torch.qint32: torch.int32}


@dataclass(frozen=True)
class QParams:
    """Everything needed to quantize or dequantize one tensor.

    ``scale`` is float32 and ``zero_point`` int64: 0-d for per-tensor, 1-d (one entry per channel
    along ``axis``) for per-channel. ``dtype`` is the quantized dtype identifier (``torch.quint8``,
    ``torch.qint8``, ``torch.qint32``) or ``torch.float16`` for fp16 weight-only quantization.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    dtype: torch.dtype
    quant_min: int
    quant_max: int
    axis: int | None = None
    is_dynamic: bool = False

    @property
    def per_channel(self) -> bool:
        return self.axis is not None
