"""Empirical bias correction (Nagel et al. 2019, section 4.2): undo the mean shift int8 weights cause.

Rounding a layer's weights to the int8 grid, ``W_q = W + E``, shifts its output by ``E x``. That
error is not zero-mean per channel (it is the same rounding for every input), so it passes on to
the next layers as a bias; with per-tensor weights on a depthwise conv it is large. Over the
calibration inputs of each layer, the mean of ``E x`` per output channel is subtracted from the
layer's bias, so the layer with int8 weights has the float layer's mean output on that data.

Only shifts the data shows are corrected: a channel whose mean ``E x`` is within ``significance``
standard errors of zero (3 by default) keeps its bias. On zero-mean inputs the sample mean of
``E x`` is noise, and subtracting it adds a constant error as large as the noise (a linear fed
batches 300x apart in scale lost cosine 0.99 -> 0.93 to it); on a CNN's post-ReLU inputs the shift
is real and the guard keeps it (ResNet-18 +1.5 dB either way).

The weight grid is the qconfig's weight observer's, so run this *after* any pass that changes
weights (cross-layer equalization) and before prepare. Convert may give a layer another grid (8-bit
weights where the 7-bit defaults of a CPU without VNNI need not apply, ``flows/weight_bits.py``):
each corrected layer keeps the mean of its GEMM input columns (``flows/bias_grid.py``), and convert
corrects its bias again for the grid it really uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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
from qplug_core.flows import bias_grid, tags
from qplug_core.flows.regions import CallCounter, resolve_qconfig
from qplug_core.kernels.reference import observed_weight_qparams

__all__ = ["BiasCorrection", "ShiftMeters", "correct_bias", "corrected_after_calibration"]


@dataclass
class BiasCorrection:
    """One corrected layer: the largest per-channel mean output shift removed, over how many calls,
    and how many of its output channels had a shift beyond the significance bound."""

    layer: str
    max_shift: float
    calls: int
    channels: int = 0


class _ShiftMeter:
    """Forward hook measuring ``E x`` per output channel: its mean over every call, and its
    spread over the first calls (for the significance bound).

    Where ``bias_grid.columns`` knows the layer's GEMM, the mean is ``E . m`` from the mean input
    column ``m`` over every call (exact, and what convert needs to correct for another grid), and
    ``E x`` itself, a second conv as costly as the layer's own, is computed for the first
    ``SPREAD_CALLS`` calls only: calibration with the meters took 2.0x the plain flow's time on
    ResNet-18 (32 batches), 1.7x with column sums, 1.4x with both. Elsewhere ``E x`` is summed
    over every call."""

    #: calls whose ``E x`` gives the spread of the shift (the mean needs no more than the columns)
    SPREAD_CALLS = 4

    def __init__(self, layer: nn.Module, qparams: Q.QParams) -> None:
        self.layer, self.qparams = layer, qparams
        self.knows_columns = bias_grid.records_columns(layer)
        channels = layer.weight.shape[0]
        self.total = torch.zeros(channels, dtype=torch.float64)
        self.squares = torch.zeros(channels, dtype=torch.float64)
        self.columns: torch.Tensor | None = None
        self.rows = 0  # GEMM rows of every call (with columns known)
        self.count = 0  # rows whose ``E x`` was summed
        self.calls = 0
        self._final_mean: torch.Tensor | None = None

    @property
    def error(self) -> torch.Tensor:
        """``W_q - W``, computed when used: held for every layer it was one more float copy of
        the model through calibration (and the peak of ``qp.quantize`` on large MLPs)."""
        weight = self.layer.weight.detach()
        return Q.fake_quantize(weight, self.qparams) - weight

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        x = args[0].detach()
        self.calls += 1
        if self.knows_columns:
            total, rows = bias_grid.columns(self.layer, x)
            self.columns = total if self.columns is None else self.columns + total
            self.rows += rows
            if self.calls > self.SPREAD_CALLS:
                return
        error = self.error
        if isinstance(self.layer, CONVS):
            shift, channel_dim = self.layer._conv_forward(x, error, None), 1
        else:
            shift, channel_dim = F.linear(x, error), -1
        moved = shift.movedim(channel_dim, -1).reshape(-1, shift.shape[channel_dim])
        self.total += moved.sum(0, dtype=torch.float64)
        self.squares += moved.square().sum(0, dtype=torch.float64)
        self.count += moved.shape[0]

    def _mean(self) -> torch.Tensor:
        """The mean shift, once calibration is over (the sums are final: computed once)."""
        if self._final_mean is None:
            self._final_mean = self.total / max(self.count, 1) if self.columns is None else \
                bias_grid.column_shift(self.layer, self.error, self.columns / max(self.rows, 1)).double()
        return self._final_mean

    def mean(self) -> torch.Tensor:
        return self._mean().float()

    def significant(self, significance: float) -> torch.Tensor:
        """Per output channel: whether the mean shift is beyond ``significance`` standard errors
        (the spread from the rows whose ``E x`` was summed, the error of a mean over all rows)."""
        sampled = max(self.count, 1)
        sampled_mean = self.total / sampled
        variance = (self.squares / sampled - sampled_mean.square()).clamp_min(0)
        rows = max(self.rows if self.columns is not None else self.count, 1)
        return self._mean().abs() > significance * (variance / rows).sqrt()

    def total_across_ranks(self, ranks: Any) -> None:
        sums = torch.cat([self.total, self.squares, torch.tensor([self.count, self.rows], dtype=torch.float64),
                          *([] if self.columns is None else [self.columns])])
        sums = ranks.total(sums)
        width = self.total.numel()
        self.total, self.squares = sums[:width], sums[width:2 * width]
        self.count, self.rows = int(sums[2 * width]), int(sums[2 * width + 1])
        if self.columns is not None:
            self.columns = sums[2 * width + 2:]

    def record(self, mask: torch.Tensor, bias: torch.Tensor) -> bias_grid.BiasRecord:
        """What convert needs to correct ``bias`` for another weight grid, or to restore it."""
        columns = None if self.columns is None else self.columns / max(self.rows, 1)
        return bias_grid.BiasRecord(columns, self.mean() * mask, original=bias.detach().clone(), mask=mask)


def _weight_grids(gm: fx.GraphModule, mapping: QConfigMapping) -> dict[str, tuple[nn.Module, Q.QParams]]:
    """node target -> (layer, its weight's int8 grid) for every weighted layer the mapping quantizes."""
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
        errors[node.target] = (layer, qparams)
    return errors


class ShiftMeters:
    """Shift meters hooked on every conv/linear ``mapping`` quantizes in ``gm``: whatever runs
    batches through ``gm`` (a float pass, or calibration of an observed graph) feeds them, then
    :meth:`correct` moves the biases. Under a torch.distributed process group the ranks' sums
    are totalled first, so every rank makes the correction one process would make on all data."""

    def __init__(self, gm: fx.GraphModule, mapping: QConfigMapping) -> None:
        if not isinstance(mapping, QConfigMapping):
            raise ConfigValidationError("correct_bias needs the QConfigMapping quantization will use "
                                        "(its weight observers define the int8 grid)",
                                        field="qconfig_mapping")
        grids = _weight_grids(gm, mapping)
        self._gm = gm
        self._meters = {name: _ShiftMeter(layer, qparams) for name, (layer, qparams) in grids.items()}
        self._handles = [layer.register_forward_hook(self._meters[name])
                         for name, (layer, _) in grids.items()]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _total_across_ranks(self) -> None:
        from qplug_core.observers.distributed import active_ranks

        ranks = active_ranks()
        if ranks is None:
            return
        for meter in self._meters.values():  # the same layers in the same order on every rank
            meter.total_across_ranks(ranks)

    def correct(self, significance: float = 3.0) -> list[BiasCorrection]:
        """Remove the measured shifts (see :func:`correct_bias`); the layers corrected."""
        self.remove()
        self._total_across_ranks()
        corrections = []
        with torch.no_grad():
            for name, meter in self._meters.items():
                if not meter.count:
                    continue
                mask = meter.significant(significance)
                if not bool(mask.any()):
                    continue
                layer, shift = meter.layer, meter.mean() * mask
                if layer.bias is None:
                    layer.bias = nn.Parameter(torch.zeros_like(shift))
                record, before = meter.record(mask, layer.bias), getattr(layer, tags.BIAS_CORRECTION, None)
                if before is not None:  # corrected again: the bias has lost both shifts
                    record.removed = record.removed + before.removed
                    record.original = before.original
                    record.mask = mask if before.mask is None else mask | before.mask
                setattr(layer, tags.BIAS_CORRECTION, record)
                layer.bias.sub_(shift)
                corrections.append(BiasCorrection(name, float(shift.abs().max()), meter.calls,
                                                  int(mask.sum())))
        self._gm.recompile()
        return corrections


def correct_bias(gm: fx.GraphModule, calibration_data: Any, *, qconfig_mapping: QConfigMapping,
                 significance: float = 3.0) -> list[BiasCorrection]:
    """Correct the bias of every conv/linear that ``qconfig_mapping`` quantizes, in place.

    ``gm`` is a fused float graph (:func:`qp.fuse_fx <qplug_core.fuse_fx>`); ``calibration_data``
    the batches calibration will use. Each output channel whose mean shift is beyond
    ``significance`` standard errors of zero is corrected (0: every channel). Layers without a
    bias get one when any channel is corrected.
    """
    meters = ShiftMeters(gm, qconfig_mapping)
    try:
        run_hooked(gm, calibration_data, [], "bias correction")
    finally:
        meters.remove()
    corrections = meters.correct(significance)
    if corrections:  # the final check then runs the user's float model, not this one
        gm.meta[tags.FLOAT_EDITED] = "bias correction"
    return corrections


@contextlib.contextmanager
def corrected_after_calibration(observed: fx.GraphModule, mapping: QConfigMapping,
                                corrections: list[BiasCorrection]) -> Iterator[None]:
    """Bias correction measured on the calibration batches themselves: meters on ``observed`` (a
    prepared graph, whose layers see the float inputs) while it calibrates, biases moved after,
    before convert; ``corrections`` gets the layers. No extra float pass, and every check and
    error of the plain flow stays where it was. Its output observers saw the uncorrected outputs:
    the shifts are small beside their ranges (:func:`correct_bias` before prepare avoids even that).
    """
    meters = ShiftMeters(observed, mapping)
    try:
        yield
    finally:
        meters.remove()
    corrections.extend(meters.correct())
