"""Embedding tables as uint8 rows with per-row scale and offset, for export.

An embedding's reference form holds its table on the 8-bit grid of per-row qparams with float zero
points, which no DequantizeLinear takes: exported as is, the table was a float32 initializer, the
ONNX file the float model's size. :class:`Int8Table` keeps the uint8 rows and dequantizes only the
rows looked up (Gather of the uint8 rows, Cast, Sub and Mul by the gathered offset and scale), to
the reference form's numbers. Bags are summed by a segment sum (ScatterND with add) instead of
``nn.EmbeddingBag``'s export, a Loop over the bags that ran ~100x slower than float in ONNX Runtime.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core import qparams as Q
from qplug_core.kernels.reference import ReferenceWeighted


def int8_table_problem(reference: ReferenceWeighted) -> str | None:
    """Why ``reference`` cannot become an :class:`Int8Table` (None if it can)."""
    module, qp = reference.module, reference.weight_qparams
    if type(module) not in (nn.Embedding, nn.EmbeddingBag):
        return "not an embedding"
    if qp.axis != 0 or qp.dtype != torch.quint8 or not qp.zero_point.is_floating_point():
        return "not per-row 8-bit qparams"
    if module.max_norm is not None:
        return "max_norm renormalises rows at run time"
    if isinstance(module, nn.EmbeddingBag) and module.mode not in ("sum", "mean"):
        return f"mode {module.mode!r} has no segment-sum form"
    return None


class Int8Table(nn.Module):
    """An ``nn.Embedding`` or ``nn.EmbeddingBag`` (sum, mean) on uint8 rows (see the module docstring)."""

    def __init__(self, reference: ReferenceWeighted):
        super().__init__()
        module, qp = reference.module, reference.weight_qparams
        self.register_buffer("qweight", Q.quantize_in_slices(module.weight, qp))
        self.register_buffer("scale", qp.scale.detach().to(torch.float32).reshape(-1, 1).clone())
        self.register_buffer("offset", qp.zero_point.detach().to(torch.float32).reshape(-1, 1).clone())
        self.bag = isinstance(module, nn.EmbeddingBag)
        self.mean = self.bag and module.mode == "mean"
        self.padding_idx = module.padding_idx if self.bag else None
        self.include_last_offset = self.bag and module.include_last_offset

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The looked-up rows dequantized as the reference form's table is: ``(q - offset) * scale``."""
        return (F.embedding(ids, self.qweight).float() - F.embedding(ids, self.offset)) * F.embedding(ids, self.scale)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        rows = self._rows(ids)
        if not self.bag:
            return rows
        counted = None if self.padding_idx is None else (ids != self.padding_idx).float()
        weights = counted
        if per_sample_weights is not None:
            weights = per_sample_weights if counted is None else per_sample_weights * counted
        if weights is not None:
            rows = rows * weights.unsqueeze(-1)
        if counted is None:
            counted = torch.ones_like(ids, dtype=torch.float32)
        if ids.dim() == 2:  # bags of one size, no offsets
            out, count = rows.sum(1), counted.sum(1, keepdim=True)
        else:
            bag_of = self._bag_of_entry(offsets, ids.shape[0])
            bags = offsets.shape[0] - 1 if self.include_last_offset else offsets.shape[0]
            out = rows.new_zeros(bags, rows.shape[1]).index_add(0, bag_of, rows)
            count = counted.new_zeros(bags).index_add(0, bag_of, counted).unsqueeze(1)
        return out / count.clamp_min(1) if self.mean else out

    def _bag_of_entry(self, offsets: torch.Tensor, entries: int) -> torch.Tensor:
        """The bag each entry of a 1-D ``ids`` belongs to: a running count of the bag starts at or
        before it (an empty bag's start coincides with the next one's, and counts too)."""
        starts = offsets[:-1] if self.include_last_offset else offsets
        marks = offsets.new_zeros(entries + 1).index_add(0, starts, torch.ones_like(starts))
        return marks[:entries].cumsum(0) - 1


__all__ = ["Int8Table", "int8_table_problem"]
