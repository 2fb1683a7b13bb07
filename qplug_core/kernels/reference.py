"""The reference (simulated) quantized form that runs anywhere.

``convert_to_reference_fx`` produces graphs built from these modules: ``Quantize`` turns a float tensor
into plain integers (uint8/int8 storage, no torch quantized dtypes), ``Dequantize`` turns them back,
and weighted float modules carry weights that were quantized and dequantized once. Every real backend
is tested against this form, and lowering reads the qparams it records.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from qplug_core import qparams as Q
from qplug_core.ir.qdq_ops import dequantize_op, quantize_op
from qplug_core.nn.computed_weights import copy_model, without_computed_weights
from qplug_core.qparams import QParams


class _QParamsHolder(nn.Module):
    """Stores one QParams as buffers so that state_dict save/load and ``.to()`` keep it."""

    def __init__(self, qparams: QParams):
        super().__init__()
        self.register_buffer("scale", qparams.scale.detach().clone().to(torch.float32))
        zero_point = qparams.zero_point.detach().clone()  # float for per-row embedding qparams
        self.register_buffer("zero_point", zero_point if zero_point.is_floating_point()
                             else zero_point.to(torch.int64))
        self.dtype = qparams.dtype
        self.quant_min = qparams.quant_min
        self.quant_max = qparams.quant_max
        self.axis = qparams.axis

    @property
    def qparams(self) -> QParams:
        return QParams(self.scale, self.zero_point, self.dtype, self.quant_min, self.quant_max, self.axis)

    def extra_repr(self) -> str:
        if self.axis is None:
            return (f"dtype={self.dtype}, scale={float(self.scale):.6g}, "
                    f"zero_point={int(self.zero_point)}")
        return f"dtype={self.dtype}, axis={self.axis}, channels={self.scale.numel()}"


class Quantize(_QParamsHolder):
    """float -> plain integer tensor with this module's qparams (reference form).

    Values clamp to the *dtype's* range, not the calibrated ``quant_max``: quantized tensors hold
    the full range, so a backend's kernels (and torch.ao's reference form) saturate there too, and
    the reference must agree with them on values beyond the calibration range. Runs
    ``torch.ops.qplug.quantize_per_*`` (one node when exported); float zero points (per-row
    embedding qparams) have no such op and use :mod:`qplug_core.qparams` directly.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low, high = Q.quant_range(self.dtype)
        qparams = dataclasses.replace(self.qparams, quant_min=low, quant_max=high)
        if self.zero_point.is_floating_point():
            return Q.quantize(x, qparams)
        return quantize_op(x, qparams)


class Dequantize(_QParamsHolder):
    """plain integer tensor -> float with this module's qparams (reference form), through
    ``torch.ops.qplug.dequantize_per_*`` like :class:`Quantize`."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        if self.zero_point.is_floating_point():
            return Q.dequantize(q, self.qparams)
        return dequantize_op(q, self.qparams)


class DynamicQuantize(nn.Module):
    """Simulates run-time (dynamic) activation quantization: per-batch min/max qparams, then q/dq.

    Mirrors what dynamic int8 kernels do internally, so reference and lowered dynamic models agree.
    Runs ``torch.ops.qplug.dynamic_fake_quantize`` (one node when exported: DynamicQuantizeLinear).
    """

    def __init__(self, dtype: torch.dtype = torch.quint8, quant_min: int = 0, quant_max: int = 255):
        super().__init__()
        self.dtype = dtype
        self.quant_min = quant_min
        self.quant_max = quant_max

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0 or self.dtype not in Q.STORAGE_DTYPE:  # float16 dynamic: float activations
            return x
        return torch.ops.qplug.dynamic_fake_quantize(x, self.quant_min, self.quant_max,
                                                     Q.STORAGE_DTYPE[self.dtype])

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, quant_min={self.quant_min}, quant_max={self.quant_max}"


class ReferenceWeighted(nn.Module):
    """A float module whose weight was quantized then dequantized once with ``weight_qparams``.

    Keeps the wrapped module (and its name in the model) so per-layer comparison and lowering find
    it; ``weight_qparams`` lets lowering re-quantize the weight exactly (the values lie on the grid).
    """

    def __init__(self, module: nn.Module, weight_qparams: QParams, weight_name: str = "weight"):
        super().__init__()
        self.module = rounded_copy(module, {weight_name: weight_qparams})
        self.weight_name = weight_name
        self.weight_qparams_holder = _QParamsHolder(weight_qparams)

    @property
    def weight_qparams(self) -> QParams:
        return self.weight_qparams_holder.qparams

    @property
    def weight(self) -> torch.Tensor:
        return weight_of(self.module, self.weight_name)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class ReferenceRecurrent(nn.Module):
    """A recurrent layer (``nn.LSTM``, ``nn.GRU``, a cell) whose weight matrices were each
    quantized then dequantized once, with the qparams recorded per matrix by name.

    The rounded weights alone do not give their scales back (an observer run on them again finds
    a slightly different one), so lowering packs each matrix with its recorded qparams: the
    kernels then hold exactly the integers and scales this form runs, at convert and at
    ``qp.load``, and what ``qp.quantize_dynamic`` packs from the float layer.
    """

    def __init__(self, module: nn.Module, weight_qparams: dict[str, QParams]):
        super().__init__()
        self.module = rounded_copy(module, weight_qparams)
        self.weight_qparams_holders = nn.ModuleDict(
            {name: _QParamsHolder(qparams) for name, qparams in weight_qparams.items()})

    @property
    def weight_qparams(self) -> dict[str, QParams]:
        return {name: holder.qparams for name, holder in self.weight_qparams_holders.items()}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def observed_weight_qparams(qconfig, weight: torch.Tensor) -> QParams | None:
    """Run ``qconfig``'s weight observer on ``weight``: its qparams (dtype only for float16),
    or ``None`` when the qconfig leaves weights in float."""
    observer = qconfig.weight()
    if observer.dtype == torch.float16:
        return QParams(torch.tensor(1.0), torch.tensor(0), torch.float16, 0, 0)
    if observer.dtype not in Q.STORAGE_DTYPE:
        return None
    observer(weight.detach())
    return observer.qparams()


def dynamic_weight_names(module: nn.Module) -> list[str]:
    """The weight matrices a dynamic kernel quantizes: an RNN's per layer and direction, a cell's
    input and hidden ones, else ``weight``."""
    if isinstance(module, nn.RNNBase):
        return [n for n in module._flat_weights_names if n.startswith("weight")]
    if isinstance(module, nn.RNNCellBase):
        return ["weight_ih", "weight_hh"]
    return ["weight"]


def dynamic_weight_qparams(qconfig, module: nn.Module) -> dict[str, QParams | None]:
    """``qconfig``'s qparams of each weight matrix a dynamic kernel quantizes, each observed on its
    own (by a fresh observer, as torch.ao does), by name; empty without a weight observer."""
    if qconfig is None or qconfig.weight is None:
        return {}
    return {name: observed_weight_qparams(qconfig, getattr(module, name))
            for name in dynamic_weight_names(module)}


def rounded_copy(module: nn.Module, weight_qparams: dict[str, QParams | None]) -> nn.Module:
    """A copy of ``module`` whose named weights lie on their int8 grid (or are float16-rounded):
    what the reference form runs, and what kernels re-quantize exactly."""
    # a computed weight (weight_norm, parametrizations) becomes a plain one: rounding it wrote a temporary
    rounded, _ = without_computed_weights(copy_model(module), inplace=True)
    with torch.no_grad():
        for name, qparams in weight_qparams.items():
            if qparams is None:
                continue
            weight = weight_of(rounded, name)
            if qparams.dtype == torch.float16:
                weight.copy_(weight.half().float())
                continue
            for part in Q.slices(weight.detach(), qparams):  # whole, its temporaries were 4x its bytes
                part.copy_(Q.fake_quantize(part, qparams))
    return rounded


def weight_of(module: nn.Module, weight_name: str) -> torch.Tensor:
    """The tensor at a dotted weight name ("0.weight" inside a fused Sequential).

    Plain attribute access, unlike ``get_parameter``, also returns parametrized weights.
    """
    owner_path, _, attr = weight_name.rpartition(".")
    return getattr(module.get_submodule(owner_path) if owner_path else module, attr)
