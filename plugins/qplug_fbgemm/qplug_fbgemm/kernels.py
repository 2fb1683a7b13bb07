"""fbgemm's weighted kernels refuse a depthwise conv whose operands can saturate its pair sums.

The depthwise kernels add pairs of u8 x s8 products in int16 with saturation on every CPU
(``passes.py``), so a pair must stay within 32,767: ``2 * input_max * weight_max``. fbgemm's
prepare gives depthwise inputs 7 bits, which keeps any int8 weight within it. A model prepared for
another backend does not: a qnnpack or onnxruntime file loaded with ``backend="fbgemm"`` brings
8-bit inputs and 8-bit weights, pairs up to 2 * 255 * 128, and the kernel clipped them silently
(19.7 dB against float where the file's reference form gives 44.5). The rule is checked when the
kernel is built, from the qparams alone: a refused conv keeps the reference form, with a warning,
and the report says why.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from qplug_core.plugin_api import ConstraintViolationError, KernelContext, KernelSpec

from qplug_fbgemm.passes import REDUCED_QUANT_MAX, is_depthwise

INT16_MAX = 32767


def with_context_step(table: dict[Any, KernelSpec],
                      step: Callable[[KernelContext], KernelContext]) -> dict[Any, KernelSpec]:
    """``table`` with every build first passing its context through ``step`` (which may refuse it)."""
    return {pattern: spec if spec.build is None else dataclasses.replace(spec, build=_stepped(spec.build, step))
            for pattern, spec in table.items()}


def _stepped(build: Callable[[KernelContext], nn.Module],
             step: Callable[[KernelContext], KernelContext]) -> Callable[[KernelContext], nn.Module]:
    def stepped_build(ctx: KernelContext) -> nn.Module:
        return build(step(ctx))
    return stepped_build


def refusing_saturating_depthwise(table: dict[Any, KernelSpec]) -> dict[Any, KernelSpec]:
    """``table`` with every built kernel first checking :func:`check_depthwise_pairs`."""
    return with_context_step(table, check_depthwise_pairs)


def check_depthwise_pairs(ctx: KernelContext) -> KernelContext:
    """``ctx``; raise :class:`ConstraintViolationError` where it is a depthwise conv whose input and
    weight integers can make a pair of products leave int16."""
    if ctx.module is None or not ctx.input_qparams or not is_depthwise(ctx.module):
        return ctx
    activation, weight = ctx.input_qparams[0], ctx.weight_qparams
    if weight is None or activation.is_dynamic:
        return ctx
    if (activation.dtype, weight.dtype) != (torch.quint8, torch.qint8):  # u8 x s8: what the kernel sums
        return ctx
    input_max, weight_max = activation.quant_max, max(-weight.quant_min, weight.quant_max)
    if 2 * input_max * weight_max <= INT16_MAX:
        return ctx
    raise ConstraintViolationError(
        f"fbgemm's depthwise convs add pairs of u8 x s8 products in int16, clipped at {INT16_MAX:,} on every "
        f"CPU, and this one's input integers reach {input_max} and its weight integers {weight_max}: a pair "
        f"can reach {2 * input_max * weight_max:,}. Its qparams were not chosen for fbgemm: qp.quantize and "
        f"qp.prepare_fx for fbgemm give depthwise inputs 7 bits ([0, {REDUCED_QUANT_MAX}]), which the kernel "
        f"runs exactly; so does qp.eager.prepare(..., backend='fbgemm')",
        field="input_qparams[0]", value=(activation.quant_min, activation.quant_max))
