"""Empirical bias correction (Nagel et al. 2019, section 4.2): undo the mean shift int8 weights cause.

Rounding a layer's weights to the int8 grid, ``W_q = W + E``, shifts its output by ``E x``. That
error is not zero-mean per channel (it is the same rounding for every input), so it passes on to
the next layers as a bias; with per-tensor weights on a depthwise conv it is large. Over the
calibration inputs of each layer, the mean of ``E x`` per output channel is subtracted from the
layer's bias, so the layer with int8 weights has the float layer's mean output on that data.

The weight grid is the qconfig's weight observer's, so run this *after* any pass that changes
weights (cross-layer equalization) and before prepare. Convert may give a layer another grid (8-bit
weights where the 7-bit defaults of a CPU without VNNI need not apply, ``flows/weight_bits.py``):
each corrected layer keeps the mean of its GEMM input columns (``flows/bias_grid.py``), and convert
corrects its bias again for the grid it really uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from qplug_core import qparams as Q
from qplug_core.algorithms._calibration import run_hooked
from qplug_core.algorithms._layers import CONVS, layer_of
from qplug_core.config import QConfigMapping
from qplug_core.errors import ConfigValidationError
from qplug_core.flows import bias_grid
from qplug_core.flows.regions import CallCounter, resolve_qconfig
from qplug_core.kernels.reference import observed_weight_qparams

__all__ = ["BiasCorrection", "correct_bias"]


@dataclass
class BiasCorrection:
    """One corrected layer: the largest per-channel mean output shift removed, over how many calls."""

    layer: str
    max_shift: float
    calls: int


class _ShiftMeter:
    """Forward hook summing ``E x`` per output channel over every call, and the GEMM input
    columns where convert can use them to correct for another grid (``bias_grid.columns``)."""

    def __init__(self, layer: nn.Module, error: torch.Tensor) -> None:
        self.layer, self.error = layer, error
        self.total = torch.zeros(error.shape[0], dtype=torch.float64)
        self.columns: torch.Tensor | None = None
        self.rows = 0
        self.count = 0
        self.calls = 0

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        x = args[0].detach()
        if isinstance(self.layer, CONVS):
            shift, channel_dim = self.layer._conv_forward(x, self.error, None), 1
        else:
            shift, channel_dim = F.linear(x, self.error), -1
        moved = shift.movedim(channel_dim, -1).reshape(-1, shift.shape[channel_dim])
        self.total += moved.sum(0, dtype=torch.float64)
        self.count += moved.shape[0]
        self.calls += 1
        if bias_grid.records_columns(self.layer):
            total, rows = bias_grid.columns(self.layer, x)
            self.columns = total if self.columns is None else self.columns + total
            self.rows += rows

    def mean(self) -> torch.Tensor:
        return (self.total / max(self.count, 1)).float()

    def record(self) -> bias_grid.BiasRecord | None:
        """What convert needs to correct the bias for another weight grid (None: not known)."""
        if self.columns is None:
            return None
        return bias_grid.BiasRecord(self.columns / max(self.rows, 1), self.mean())


def _weight_errors(gm: fx.GraphModule, mapping: QConfigMapping) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """node target -> (layer, W_q - W) for every weighted layer the mapping quantizes."""
    modules = dict(gm.named_modules(remove_duplicate=False))
    counter, errors = CallCounter(), {}
    for node in gm.graph.nodes:
        layer = layer_of(gm, node)
        if layer is None or node.target in errors:
            continue
        qconfig = resolve_qconfig(mapping, node, modules, counter)
        if qconfig is None or qconfig.weight is None:
            continue
        qparams = observed_weight_qparams(qconfig, layer.weight)
        if qparams is None or qparams.dtype not in Q.STORAGE_DTYPE:
            continue
        weight = layer.weight.detach()
        errors[node.target] = (layer, Q.fake_quantize(weight, qparams) - weight)
    return errors


def correct_bias(gm: fx.GraphModule, calibration_data: Any, *,
                 qconfig_mapping: QConfigMapping) -> list[BiasCorrection]:
    """Correct the bias of every conv/linear that ``qconfig_mapping`` quantizes, in place.

    ``gm`` is a fused float graph (:func:`qp.fuse_fx <qplug_core.fuse_fx>`); ``calibration_data``
    the batches calibration will use. Layers without a bias get one.
    """
    if not isinstance(qconfig_mapping, QConfigMapping):
        raise ConfigValidationError("correct_bias needs the QConfigMapping quantization will use "
                                    "(its weight observers define the int8 grid)",
                                    field="qconfig_mapping")
    errors = _weight_errors(gm, qconfig_mapping)
    meters = {name: _ShiftMeter(layer, error) for name, (layer, error) in errors.items()}
    handles = [layer.register_forward_hook(meters[name]) for name, (layer, _) in errors.items()]
    run_hooked(gm, calibration_data, handles, "bias correction")
    corrections = []
    with torch.no_grad():
        for name, meter in meters.items():
            if not meter.calls:
                continue
            layer, shift = meter.layer, meter.mean()
            if layer.bias is None:
                layer.bias = nn.Parameter(torch.zeros_like(shift))
            record, before = meter.record(), getattr(layer, bias_grid.RECORD, None)
            if record is not None:  # corrected again: the bias has lost both shifts
                record.removed = record.removed + (0 if before is None else before.removed)
                record.original = layer.bias.detach().clone() if before is None else before.original
                setattr(layer, bias_grid.RECORD, record)
            layer.bias.sub_(shift)
            corrections.append(BiasCorrection(name, float(shift.abs().max()), meter.calls))
    gm.recompile()
    return corrections
