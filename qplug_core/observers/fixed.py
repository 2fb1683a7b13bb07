"""Observers that do not look at data: fixed qparams (sigmoid, tanh, ...) and placeholders."""

from __future__ import annotations

from typing import Any

import torch

from qplug_core.errors import ConfigValidationError
from qplug_core.observers.base import ObserverBase
from qplug_core.observers.ranks import Ranks


class FixedQParamsObserver(ObserverBase):
    """Reports the same qparams whatever it sees.

    For ops whose output range is known in advance (sigmoid and softmax: [0, 1]; tanh: [-1, 1]),
    where a fixed scale is both exact and lets backends use lookup-table kernels.
    """

    def __init__(self, scale: float, zero_point: int, dtype: torch.dtype = torch.quint8,
                 qscheme: torch.qscheme = torch.per_tensor_affine, quant_min: int = 0,
                 quant_max: int = 255, **kwargs: Any) -> None:
        if kwargs.get("is_dynamic"):
            raise ConfigValidationError("fixed qparams cannot be used for dynamic quantization",
                                        field="is_dynamic", value=True)
        super().__init__(dtype=dtype, qscheme=qscheme, quant_min=quant_min, quant_max=quant_max,
                         **kwargs)
        if not (isinstance(scale, (int, float)) and 0 < scale < float("inf")):
            raise ConfigValidationError(f"scale must be a positive finite number, got {scale!r}",
                                        field="scale", value=scale)
        if not self.quant_min <= zero_point <= self.quant_max:
            raise ConfigValidationError(
                f"zero_point={zero_point} is outside [{self.quant_min}, {self.quant_max}]",
                field="zero_point", value=zero_point)
        self.register_buffer("scale", torch.tensor([scale], dtype=torch.float32))
        self.register_buffer("zero_point", torch.tensor([zero_point], dtype=torch.int32))

    @property
    def has_data(self) -> bool:
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reduce_across_ranks(self, ranks: Ranks) -> None:
        """Nothing to reduce: the qparams are fixed by construction, the same on every rank."""

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale, self.zero_point


class PlaceholderObserver(ObserverBase):
    """Carries a target dtype without collecting statistics.

    Used for fp16 weight-only quantization and for the activations of dynamically quantized ops,
    whose qparams are computed at run time by the kernel.
    """

    allows_float_dtype = True

    def __init__(self, dtype: torch.dtype = torch.float32, **kwargs: Any) -> None:
        super().__init__(dtype=dtype, **kwargs)

    @property
    def has_data(self) -> bool:
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reduce_across_ranks(self, ranks: Ranks) -> None:
        """Nothing to reduce: a placeholder collects no statistics."""

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        kind = "dynamic" if self.is_dynamic else f"{self.dtype}"
        raise ConfigValidationError(
            f"{self._where()} is a placeholder for {kind} quantization and has no qparams; "
            "dynamic ops compute them at run time and float16 needs none (use a MinMaxObserver "
            "or HistogramObserver for static quantization)", field="observer",
            value=type(self).__name__)

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, is_dynamic={self.is_dynamic}"
