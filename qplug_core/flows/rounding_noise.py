"""How far a reference-form partition's float outputs are from the same partition without
activation rounding: the quantization noise the reference form itself carries.

A multi-region partition compiled by a runtime rounds differently here and there, and the
differences drift through it; how much drift is fine depends on how much rounding there is to
differ, which the reference form measures. Its activation quantizers are run without rounding
(each value still clamped to its quantizer's range, as the reference form saturates it; weights
stay int8), so the difference is what its activation roundings alone add.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from qplug_core import qparams as Q
from qplug_core.ir.quiet import quiet_torch
from qplug_core.kernels.reference import Dequantize, Quantize

#: a compiled form's error may be at most this many times the reference form's own
#: activation-rounding noise: a runtime rounding otherwise adds about as much again (sqrt 2), one
#: off by 20 dB ten times as much (the partition contract, ``flows/delegate.py``; ``backend="auto"``)
MAX_NOISE_RATIO = 2.0

_QUANTIZE_OPS = {torch.ops.qplug.quantize_per_tensor.default, torch.ops.qplug.quantize_per_channel.default}
_DEQUANTIZE_OPS = {torch.ops.qplug.dequantize_per_tensor.default, torch.ops.qplug.dequantize_per_channel.default}


class _Unrounded(fx.Interpreter):
    """Runs a reference-form graph with every float -> int quantize kept in float, clamped to its
    range, and the dequantize reading it passing it on."""

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        module = self.fetch_attr(str(target))
        if isinstance(module, Quantize) and _floating(args[0]):
            return _clamped(args[0], module.scale, module.zero_point, Q.quant_range(module.dtype), module.axis)
        if isinstance(module, Dequantize) and _floating(args[0]):
            return args[0]
        return super().call_module(target, args, kwargs)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target in _QUANTIZE_OPS and _floating(args[0]):
            if target is torch.ops.qplug.quantize_per_channel.default:
                return _clamped(args[0], args[1], args[2], (args[4], args[5]), args[3])
            return _clamped(args[0], args[1], args[2], (args[3], args[4]), None)
        if target in _DEQUANTIZE_OPS and _floating(args[0]):
            return args[0]
        return super().call_function(target, args, kwargs)


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _clamped(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_range: tuple[int, int],
             axis: int | None) -> torch.Tensor:
    """``x`` clamped to what a quantizer with these qparams represents, not rounded."""
    shape = [1] * x.dim()
    if axis is not None and scale.numel() > 1:
        shape[axis] = -1
    scale, zero_point = scale.reshape(shape).to(x.dtype), zero_point.reshape(shape).to(x.dtype)
    low, high = quant_range
    return torch.maximum(torch.minimum(x, (high - zero_point) * scale), (low - zero_point) * scale)


def rounding_noise(reference: fx.GraphModule, inputs: tuple, expected: list) -> list[float | None]:
    """The L2 norm of each float output's activation-rounding noise: ``expected`` (the reference
    form's outputs on ``inputs``) minus the same partition run without rounding. None for an
    integer output, and for all of them where the partition cannot run so (a quantize whose result
    it reads as integers)."""
    try:  # quietly: a traced submodule that raises prints its code to stderr before it re-raises
        with torch.no_grad(), quiet_torch((), stderr=True):
            unrounded = _Unrounded(reference).run(*inputs)
    except Exception:  # noqa: BLE001 - no noise to measure: the caller says what it holds instead
        return [None] * len(expected)
    got = list(unrounded) if isinstance(unrounded, (tuple, list)) else [unrounded]
    if len(got) != len(expected):
        return [None] * len(expected)
    return [float((ref.double() - free.double()).norm())
            if _floating(ref) and _floating(free) and free.shape == ref.shape else None
            for ref, free in zip(expected, got)]
