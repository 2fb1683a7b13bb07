"""Int8 linear with one static activation scale: per-tensor qparams calibrated ahead of time.

The per-token linear (:class:`~qplug_core.kernels.per_token.PerTokenDynamicLinear`) finds each
token's range at run time; this one uses a range measured on calibration data (after
SmoothQuant, which is what makes one range for every token workable on LLM activations), so the
two reductions per call go away and values outside the range are clamped. The integer GEMM, the
weight layout and the zero-point correction are the per-token linear's.
"""

from __future__ import annotations

import torch
from torch import nn

from qplug_core.errors import ConfigValidationError
from qplug_core.kernels.per_token import PerTokenDynamicLinear

_EPS = torch.finfo(torch.float32).eps


def static_activation_qparams(low: float, high: float) -> tuple[float, float]:
    """(scale, zero point on the uint8 grid) for the range [low, high] widened to include 0."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = max((high - low) / 255.0, _EPS)
    return scale, float(min(max(round(-low / scale), 0), 255))


class StaticInt8Linear(PerTokenDynamicLinear):
    """``nn.Linear`` as int8 x int8 -> int32 with a fixed asymmetric activation grid
    (``activation_scale``, ``activation_zero_point`` on the uint8 grid) and per-channel weights."""

    one_input_scale = True

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 activation_scale: float, activation_zero_point: float, *, simulate: bool = False,
                 gemm: str | None = None) -> None:
        super().__init__(weight_int8, weight_scale, bias, simulate=simulate, gemm=gemm)
        if not (activation_scale > 0 and 0 <= activation_zero_point <= 255):
            raise ConfigValidationError(f"activation scale must be > 0 and zero point in [0, 255], got "
                                        f"{activation_scale}, {activation_zero_point}", field="activation_scale")
        self.register_buffer("activation_scale", torch.tensor(float(activation_scale)))
        self.register_buffer("activation_zero_point", torch.tensor(float(activation_zero_point)))

    @classmethod
    def from_float_range(cls, linear: nn.Linear, low: float, high: float, *, simulate: bool = False,
                         gemm: str | None = None) -> StaticInt8Linear:
        """From a float linear and the range its input took on calibration data."""
        dynamic = PerTokenDynamicLinear.from_float(linear, simulate=simulate, gemm=gemm)
        scale, zero_point = static_activation_qparams(low, high)
        return cls(dynamic.weight_int8_t.t(), dynamic.weight_scale, dynamic.bias, scale, zero_point,
                   simulate=simulate, gemm=dynamic.gemm)

    def _quantized_input(self, x: torch.Tensor, unsigned: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        zero_point = self.activation_zero_point if unsigned else self.activation_zero_point - 128
        low, high = (0, 255) if unsigned else (-128, 127)
        codes = torch.round(x / self.activation_scale).add_(zero_point).clamp_(low, high)
        rows = x.shape[:-1] + (1,)
        return (codes.to(torch.uint8 if unsigned else torch.int8), self.activation_scale.expand(rows),
                zero_point.expand(rows))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, static activations (scale {float(self.activation_scale):.3g})"
