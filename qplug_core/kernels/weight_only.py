"""The weight-only kernel contract, the core's reference kernel and torch's packed kernels.

A kernel says which schemes it runs (:meth:`WeightOnlyKernel.supports`), packs a
:class:`~qplug_core.kernels.weight_only_scheme.QuantizedWeight` once into whatever it needs
(:meth:`~WeightOnlyKernel.pack`), and computes ``y = x @ dequantize(W).T + b`` for a 2-d float
``x`` ``[M, K]`` (:meth:`~WeightOnlyKernel.run`). Kernels may round activations (ONNX Runtime's
int8 path does); the selection checks every kernel against :class:`ReferenceKernel` before using it
(:mod:`qplug_core.weight_only.selection`). Backends add kernels through the
``qplug_weight_only_kernels`` hook.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from qplug_core.kernels.weight_only_scheme import QuantizedWeight, WeightOnlyScheme


class WeightOnlyKernel:
    """Base class of weight-only kernels; subclass and override the three methods.

    ``name`` identifies the kernel in reports and in ``qp.quantize_weights(kernel=...)``; keep it
    unique (prefix it with your backend's name).
    """

    name: str = "weight-only kernel"
    #: True for a kernel computing outside PyTorch (a runtime given numpy arrays): torch.jit.trace
    #: would record its output as a constant, so tracing a model using it is refused
    runs_outside_torch: bool = False

    def supports(self, scheme: WeightOnlyScheme, shape: tuple[int, int],
                 activation_dtype: torch.dtype) -> str | None:
        """``None`` when this kernel runs ``scheme`` for a weight of ``shape`` ``(N, K)`` on
        activations of ``activation_dtype``, else the reason it does not (shown in reports)."""
        raise NotImplementedError

    def pack(self, weight: QuantizedWeight) -> Any:
        """Prepare ``weight`` once (repacking, sessions); the result is passed to :meth:`run`."""
        raise NotImplementedError

    def run(self, packed: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ dequantize(W).T + bias`` for ``x`` ``[M, K]`` (contiguous); returns ``[M, N]``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class ReferenceKernel(WeightOnlyKernel):
    """Dequantize, then ``F.linear``: slow but runs every scheme; the oracle of the others."""

    name = "reference"

    def supports(self, scheme, shape, activation_dtype):
        return None if activation_dtype.is_floating_point else f"activations must be float, not {activation_dtype}"

    def pack(self, weight):
        return weight

    def run(self, packed, x, bias):
        return F.linear(x, packed.dequantize(x.dtype), bias)


class DequantizedKernel(ReferenceKernel):
    """The reference kernel on a weight dequantized once, at packing, to ``dtype``: for a layer run
    on many batches in a row (calibration runs each quantized block again on every batch; the
    reference kernel dequantizing at each call made that run 2.4x a float one), at the cost of a
    float copy of the weight while it is packed. Not a selectable kernel."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype

    def pack(self, weight):
        return weight.dequantize(self._dtype)

    def run(self, packed, x, bias):
        return F.linear(x, packed, bias)


def _torch_op_reason(op: str, activation_dtype: torch.dtype) -> str | None:
    """Why torch's ``aten.<op>`` cannot run here (activation dtype, an older torch), or ``None``."""
    if activation_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"activations float32/bfloat16/float16, not {activation_dtype}"
    if not hasattr(torch.ops.aten, op):
        return f"this torch has no aten.{op}"
    return None


class TorchInt8Kernel(WeightOnlyKernel):
    """``torch.ops.aten._weight_int8pack_mm``: symmetric int8, one scale per output channel."""

    name = "torch-int8pack"

    def supports(self, scheme, shape, activation_dtype):
        if scheme.bits != 8 or not scheme.symmetric:
            return "symmetric int8 only"
        if scheme.group_size not in (None, shape[1]):
            return "one scale per output channel only (group_size=None)"
        return _torch_op_reason("_weight_int8pack_mm", activation_dtype)

    def pack(self, weight):
        signed = (weight.data.to(torch.int16) - weight.scheme.midpoint).to(torch.int8)
        return signed.contiguous(), weight.scales.reshape(-1).contiguous()

    def run(self, packed, x, bias):
        data, scales = packed
        y = torch.ops.aten._weight_int8pack_mm(x, data, scales.to(x.dtype))
        return y if bias is None else y + bias


class TorchInt4Kernel(WeightOnlyKernel):
    """``torch.ops.aten._weight_int4pack_mm_for_cpu``: int4, groups of 32 to 256.

    torch's dequantization is ``(q - 8) * scale + zero``, so a zero point ``z`` becomes
    ``zero = (8 - z) * scale``.
    """

    name = "torch-int4pack"
    GROUP_SIZES = (32, 64, 128, 256)

    def supports(self, scheme, shape, activation_dtype):
        if scheme.bits != 4:
            return "int4 only"
        if (scheme.group_size or shape[1]) not in self.GROUP_SIZES:
            return f"group_size one of {self.GROUP_SIZES}"
        if shape[0] % 16:
            return "out_features a multiple of 16"
        return _torch_op_reason("_weight_int4pack_mm_for_cpu", activation_dtype)

    def pack(self, weight):
        q = weight.integers().to(torch.int32).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        zero = (8 - weight.zero_point_tensor().to(torch.float32)) * weight.scales
        scale_and_zero = torch.stack((weight.scales.T, zero.T), dim=-1).contiguous()
        return packed, weight.group_size, scale_and_zero

    def run(self, packed, x, bias):
        data, group_size, scale_and_zero = packed
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, data, group_size, scale_and_zero.to(x.dtype))
        return y if bias is None else y + bias


class RowSplitKernel(WeightOnlyKernel):
    """``few`` for up to ``max_rows`` activation rows, ``many`` above: one layer, two regimes.

    Kernels written for decoding one token (torch's packed ops) take time in proportion to the
    rows, while dequantize-then-GEMM pays its dequantization once per call: on a 1536 x 384 int4
    layer torch's ``_weight_int4pack_mm_for_cpu`` took 1.1 ms at one row and 1,070 ms at 1,024
    (the reference 3.2 and 9.9 ms, fp32 ``F.linear`` 0.12 and 8.3 ms; Intel Xeon, one thread). The
    selection measures where ``few`` stops winning (:mod:`qplug_core.weight_only.selection`).
    """

    def __init__(self, few: WeightOnlyKernel, many: WeightOnlyKernel, max_rows: int):
        self.few, self.many, self.max_rows = few, many, max_rows
        self.name = f"{few.name} (up to {max_rows} rows; {many.name} above)"

    def supports(self, scheme, shape, activation_dtype):
        return self.few.supports(scheme, shape, activation_dtype) or self.many.supports(
            scheme, shape, activation_dtype)

    def pack(self, weight):
        return self.few.pack(weight), self.many.pack(weight)

    def run(self, packed, x, bias):
        if x.shape[0] <= self.max_rows:
            return self.few.run(packed[0], x, bias)
        return self.many.run(packed[1], x, bias)


#: the kernels the core always offers (plugins add theirs through the hook)
CORE_KERNELS: tuple[WeightOnlyKernel, ...] = (ReferenceKernel(), TorchInt8Kernel(), TorchInt4Kernel())
