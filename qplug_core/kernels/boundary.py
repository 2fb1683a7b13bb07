"""The float <-> quantized boundary of a lowered model (QuantStub / DeQuantStub replacements)."""

from __future__ import annotations

import torch

from qplug_core.errors import BackendUnavailableError
from qplug_core.kernels._common import (
    SELF_TEST_INPUT,
    KernelModule,
    activation_qparams,
    check_against,
    forward_quiet,
)
from qplug_core.kernels.base import KernelContext
from qplug_core.qparams import QParams


class Quantize(KernelModule):
    """float -> per-tensor quint8/qint8 with scale/zero-point fixed at build time."""

    def __init__(self, qparams: QParams):
        super().__init__()
        self.scale, self.zero_point, self.dtype = activation_qparams(qparams, "Quantize.qparams")

    @classmethod
    def from_context(cls, ctx: KernelContext) -> Quantize:
        return cls(ctx.output_qparams)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with forward_quiet():
            return torch.quantize_per_tensor(x, self.scale, self.zero_point, self.dtype)

    @classmethod
    def self_test(cls, engine: str) -> None:
        x = torch.linspace(-2.0, 2.0, 101)
        check_against(cls(SELF_TEST_INPUT)(x), x, cls.__name__, engine)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, zero_point={self.zero_point}, dtype={self.dtype}"


class Dequantize(KernelModule):
    """quantized -> float32, in the default (contiguous) memory layout.

    Quantized convs return channels_last tensors; float code after them was written for the float
    model's contiguous outputs (``view``, ``resize_``), so the float side gets that layout back.
    """

    @classmethod
    def from_context(cls, ctx: KernelContext) -> Dequantize:
        return cls()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.dequantize().contiguous()

    @classmethod
    def self_test(cls, engine: str) -> None:
        q = Quantize(SELF_TEST_INPUT)(torch.linspace(-1.0, 1.0, 33))
        expected = (q.int_repr().double() - q.q_zero_point()) * q.q_scale()
        if not torch.allclose(cls()(q).double(), expected):
            raise BackendUnavailableError(f"Dequantize self-test failed on {engine!r}", backend=engine)
