"""Limits a backend declares once, checked before each of its kernels builds.

A vendor's runtime may accumulate a whole dot product in int16 (``Int8Arithmetic.INT16``), or
take symmetric weights only (``BackendPlugin.symmetric_weights``). Declared as facts, the core
refuses each layer that breaks one (``ConstraintViolationError`` from the kernel's build: that
layer keeps the reference form, and the warning and the report say why), where each kernel's
``build`` used to redo the bound maths (report s30/vendor, finding 5).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from qplug_core.errors import ConstraintViolationError
from qplug_core.kernels.arithmetic import INT16_MAX
from qplug_core.kernels.base import KernelContext, KernelSpec
from qplug_core.qparams import QParams, quantize

_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def worst_dot_product(weight: torch.Tensor, weight_qparams: QParams, input_qparams: QParams,
                      transposed: bool = False) -> int:
    """The largest |sum of products| one output of this layer can reach on any input: each
    output's |integer weights - zero point| summed, times the input's widest code from its zero
    point (an upper bound for a transposed conv, whose outputs take a subset of the taps)."""
    codes = quantize(weight.detach(), weight_qparams).long()
    zero_point = weight_qparams.zero_point.long()
    if weight_qparams.axis is not None:
        zero_point = zero_point.reshape([-1 if d == weight_qparams.axis % codes.dim() else 1
                                         for d in range(codes.dim())])
    centred = (codes - zero_point).abs()
    rows = (centred.transpose(0, 1) if transposed else centred).flatten(1).sum(dim=1)
    x_zero = int(input_qparams.zero_point.reshape(-1)[0])
    widest = max(abs(input_qparams.quant_max - x_zero), abs(input_qparams.quant_min - x_zero))
    return int(rows.max()) * widest


def limit_problem(ctx: KernelContext, *, int16_accumulator: bool, symmetric_weights: bool) -> str:
    """Why a weighted layer breaks a declared limit ('' if it keeps them, or has no int8 weight)."""
    weight = ctx.weight_qparams
    if weight is None or weight.dtype != torch.qint8 or ctx.root is None:
        return ""
    if symmetric_weights and (bool((weight.zero_point != 0).any()) or weight.quant_min != -weight.quant_max):
        return (f"the backend takes symmetric weights only (zero point 0, range [-q, q]), this layer's are "
                f"in [{weight.quant_min}, {weight.quant_max}] with zero point(s) "
                f"{sorted(set(weight.zero_point.reshape(-1).tolist()))[:4]}: use a symmetric weight observer "
                "(the backend's default qconfig mapping has one)")
    static = ctx.input_qparams and not ctx.input_qparams[0].is_dynamic
    if int16_accumulator and static:
        worst = worst_dot_product(ctx.root.weight, weight, ctx.input_qparams[0],
                                  transposed=isinstance(ctx.root, _TRANSPOSED))
        if worst > INT16_MAX:
            return (f"the backend accumulates each dot product in int16, and this layer's can reach "
                    f"{worst} (> {INT16_MAX}): fewer or smaller weights per output, or a narrower input or "
                    "weight range (quant_min/quant_max), fit it")
    return ""


def within_limits(kernels: dict[Any, KernelSpec], *, int16_accumulator: bool,
                  symmetric_weights: bool) -> dict[Any, KernelSpec]:
    """``kernels`` whose builds first refuse a layer breaking a declared limit; unchanged when
    none is declared (or when the table is not a dict, for the hook's return check to name)."""
    if not (int16_accumulator or symmetric_weights) or not isinstance(kernels, dict):
        return kernels

    def limited(spec: KernelSpec) -> KernelSpec:
        build = spec.build
        if build is None:
            return spec

        def checked(ctx: KernelContext) -> nn.Module:
            problem = limit_problem(ctx, int16_accumulator=int16_accumulator,
                                    symmetric_weights=symmetric_weights)
            if problem:
                raise ConstraintViolationError(problem)
            return build(ctx)
        return dataclasses.replace(spec, build=checked)
    return {key: limited(spec) if isinstance(spec, KernelSpec) else spec for key, spec in kernels.items()}


__all__ = ["limit_problem", "within_limits", "worst_dot_product"]
