"""Bias correction's record on a layer, so convert can correct the bias for the weight grid it
really gives the layer.

Bias correction (``algorithms/bias_correction.py``) runs before prepare and removes the mean
output shift ``E x`` of the qconfig's weight grid. Convert may give a layer another grid: on x86
CPUs without VNNI the defaults are 7-bit weights, and convert chooses 8 bits per layer where no
int16 pair sum saturates (``flows/weight_bits.py``); the 7-bit correction is then wrong for that
layer. The shift is linear in ``E``: its mean over the calibration data is ``E . m`` with ``m``
the mean GEMM input column (the layer's input for a linear, its im2col for a conv). So the
correction records ``m`` and the shift it removed, and :func:`regrid` replaces that shift with the
one of the grid convert chose (:func:`restore`: with none, for a layer convert leaves float).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core import qparams as Q
from qplug_core.flows.tags import BIAS_CORRECTION


@dataclass
class BiasRecord:
    """A corrected layer's mean GEMM input column (weight order: ``in_features``, or a conv's
    ``(c_in, kh, kw)`` flattened) and the shift its bias has had removed."""

    #: None: a GEMM :func:`columns` does not know (the correction stays the qconfig grid's)
    columns: torch.Tensor | None
    removed: torch.Tensor
    #: the bias before any correction (zeros where the layer had none): :func:`restore` puts it back
    original: torch.Tensor | None = None
    #: the output channels corrected (a shift beyond its noise on the calibration data); None: all
    mask: torch.Tensor | None = None


def records_columns(layer: nn.Module) -> bool:
    """Whether :func:`columns` knows ``layer``'s GEMM (linear; 1d/2d conv, numeric zero padding)."""
    if isinstance(layer, nn.Linear):
        return True
    return (isinstance(layer, (nn.Conv1d, nn.Conv2d)) and not isinstance(layer.padding, str)
            and layer.padding_mode == "zeros")


def columns(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the sum of ``layer``'s GEMM input rows for input ``x``, how many rows)."""
    if isinstance(layer, nn.Linear):
        rows = x.reshape(-1, x.shape[-1]).double()
        return rows.sum(0), rows.shape[0]
    kernel, dilation, padding, stride = layer.kernel_size, layer.dilation, layer.padding, layer.stride
    if isinstance(layer, nn.Conv1d):  # a 2d conv over a height of 1
        x = x.unsqueeze(-2)
        kernel, dilation, padding, stride = ((1, kernel[0]), (1, dilation[0]), (0, padding[0]),
                                             (1, stride[0]))
    if x.dim() == 3:  # an unbatched input
        x = x.unsqueeze(0)
    # the sum of each im2col row is the sum of one strided window of the input: summing the batch
    # first and slicing, instead of unfolding (~9x the input's memory for a 3x3 conv), is what
    # keeps bias correction's share of calibration small
    summed = F.pad(x.double().sum(0), (padding[1], padding[1], padding[0], padding[0]))
    rows = [(summed.shape[d + 1] - dilation[d] * (kernel[d] - 1) - 1) // stride[d] + 1 for d in (0, 1)]
    sums = [summed[:, i * dilation[0]:i * dilation[0] + stride[0] * (rows[0] - 1) + 1:stride[0],
                   j * dilation[1]:j * dilation[1] + stride[1] * (rows[1] - 1) + 1:stride[1]].sum((1, 2))
            for i in range(kernel[0]) for j in range(kernel[1])]
    return torch.stack(sums, 1).reshape(-1), x.shape[0] * rows[0] * rows[1]


def column_shift(layer: nn.Module, error: torch.Tensor, mean_columns: torch.Tensor) -> torch.Tensor:
    """The mean output shift ``E . m`` per output channel of weight error ``error``."""
    groups = getattr(layer, "groups", 1)
    e = error.double().reshape(groups, error.shape[0] // groups, -1)
    return (e * mean_columns.reshape(groups, 1, -1)).sum(-1).reshape(-1).float()


def regrid(module: nn.Module, qparams: Q.QParams) -> None:
    """Correct the bias of each layer in ``module`` that bias correction recorded for the weight
    grid ``qparams`` (the one convert gives it) instead of the one it was corrected for."""
    for layer in module.modules():
        record = getattr(layer, BIAS_CORRECTION, None)
        if record is None or record.columns is None:
            continue
        weight = layer.weight.detach()
        shift = column_shift(layer, Q.fake_quantize(weight, qparams) - weight, record.columns)
        if record.mask is not None:
            shift = shift * record.mask
        with torch.no_grad():
            layer.bias.add_(record.removed - shift)
        record.removed = shift


def restore(module: nn.Module) -> None:
    """Give back the shift bias correction removed from each layer in ``module`` that convert
    leaves float (an accuracy target's fallback): it has no int8 weights to correct for."""
    for layer in module.modules():
        record = getattr(layer, BIAS_CORRECTION, None)
        if record is not None and record.original is not None:
            with torch.no_grad():
                layer.bias.copy_(record.original)  # exactly: b - r + r need not round back to b
            record.removed = torch.zeros_like(record.removed)


__all__ = ["BiasRecord", "column_shift", "columns", "records_columns", "regrid", "restore"]
