"""The float <-> quantized boundary of a lowered model (QuantStub / DeQuantStub replacements)."""

from __future__ import annotations

import torch

from qplug_core.errors import BackendUnavailableError
from qplug_core.kernels._common import (
    SELF_TEST_INPUT,
    KernelModule,
    activation_qparams,
    check_against,
    conv1d_layout,
    forward_quiet,
)
from qplug_core.kernels.base import KernelContext
from qplug_core.qparams import QParams


class Quantize(KernelModule):
    """float -> per-tensor quint8/qint8 with scale/zero-point fixed at build time.

    ``keep_conv1d_layout`` (set by lowering where only int8 Conv1d read the result, see
    ``flows/conv1d_layout.py``): a float tensor in a quantized Conv1d's output layout is quantized
    as its 4-D channels-last view, so it keeps that layout, which the conv reads fastest.
    """

    keep_conv1d_layout = False

    def __init__(self, qparams: QParams):
        super().__init__()
        self.scale, self.zero_point, self.dtype = activation_qparams(qparams, "Quantize.qparams")

    @classmethod
    def from_context(cls, ctx: KernelContext) -> Quantize:
        return cls(ctx.output_qparams)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        view = conv1d_layout(x) if self.keep_conv1d_layout else None
        with forward_quiet():
            if view is not None:
                return torch.quantize_per_tensor(view, self.scale, self.zero_point, self.dtype).squeeze(2)
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
    With ``keep_conv1d_layout`` (set by lowering where only elementwise float ops lead to the next
    int8 Conv1d) a Conv1d's output keeps its layout: the transposing copy to contiguous is most of
    the time (87 vs 12 us at 1 x 64 x 2000).
    """

    keep_conv1d_layout = False

    @classmethod
    def from_context(cls, ctx: KernelContext) -> Dequantize:
        return cls()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        view = conv1d_layout(x) if self.keep_conv1d_layout else None
        if view is not None:
            return view.dequantize().squeeze(2)
        return x.dequantize().contiguous()

    @classmethod
    def self_test(cls, engine: str) -> None:
        q = Quantize(SELF_TEST_INPUT)(torch.linspace(-1.0, 1.0, 33))
        expected = (q.int_repr().double() - q.q_zero_point()) * q.q_scale()
        if not torch.allclose(cls()(q).double(), expected):
            raise BackendUnavailableError(f"Dequantize self-test failed on {engine!r}", backend=engine)
