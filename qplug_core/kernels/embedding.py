"""Weight-only 8-bit Embedding / EmbeddingBag (per-row float scale and offset), and torch's fused
bag lookups shared with ``qp.quantize_weights``' tables.

``embedding_bag_byte_prepack`` stores each row as uint8 plus its own float scale and minimum in a
plain ``torch.uint8`` tensor, so no deprecated quantized dtype is involved. Indices in, float out.
The per-row qparams come from the row's min/max (the op's own rule), not from calibration.
A table quantized by qplug's own scheme is laid out the same way by :func:`fused_rows` (4-bit rows:
two values per byte, even one low, then a float16 scale and bias), where one scale covers a row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.errors import ConfigValidationError, ConstraintViolationError
from qplug_core.kernels.base import KernelContext, engine_context
from qplug_core.kernels.weight_only_scheme import QuantizedWeight

_Q = torch.ops.quantized


def _pack_rows(mod: nn.Module, engine: str | None, zero_row: int | None = None) -> torch.Tensor:
    """The table's 8-bit rows; ``zero_row`` is packed as zeros (exactly: its scale and minimum are 0)."""
    if mod.max_norm is not None:
        raise ConstraintViolationError(f"{type(mod).__name__}: max_norm renormalises rows at run "
                                       f"time and cannot be quantized ahead of time", field="max_norm")
    weight = mod.weight.detach().float().clone()
    if zero_row is not None:
        weight[zero_row] = 0
    with engine_context(engine):
        return _Q.embedding_bag_byte_prepack(weight.contiguous())


def _lookup(packed: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
            per_sample_weights: torch.Tensor | None, include_last_offset: bool, bits: int = 8) -> torch.Tensor:
    """The weighted sums of ``bits``-bit rows; torch's op refuses strided indices (``x_cat[:, i]``,
    one column of a tabular model's categorical matrix), which ``nn.Embedding`` takes."""
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights.contiguous()
    op = _Q.embedding_bag_byte_rowwise_offsets if bits == 8 else _Q.embedding_bag_4bit_rowwise_offsets
    return op(packed, indices.contiguous(), offsets.contiguous(), False, 0, False, per_sample_weights, None,
              include_last_offset)


#: float16's smallest normal: a 4-bit row's scale below it would lose its precision
_FP16_NORMAL = torch.finfo(torch.float16).tiny


def fused_rows(weight: QuantizedWeight, zero_row: int | None = None) -> torch.Tensor | None:
    """``weight`` (a table quantized by qplug's scheme) in the layout of torch's fused bag ops, with
    ``zero_row`` packed as zeros; ``None`` where they cannot compute it: more than one scale per row,
    an odd 4-bit row, or a 4-bit scale float16 cannot hold to its precision (a row of zeros, scaled
    by float32's tiny, holds: it stays zeros). A copy of the table: derived data, made once."""
    n, k = weight.shape
    bits, scales = weight.scheme.bits, weight.scales
    if weight.group_size != k or (bits == 4 and k % 2):
        return None
    scale_dtype = torch.float32 if bits == 8 else torch.float16
    if bits == 4:
        zeros = scales == torch.finfo(torch.float32).tiny  # quantize()'s clamp: only zeros in that row
        big = torch.finfo(torch.float16).max / (2 * weight.scheme.qmax)
        if not bool(((scales >= _FP16_NORMAL) & (scales <= big) | zeros).all()):
            return None
    bias = -(weight.zero_point_tensor().double() * scales.double())
    tail = torch.cat([scales.to(scale_dtype), bias.to(scale_dtype)], dim=1).view(torch.uint8)
    packed = torch.cat([weight.data, tail], dim=1)
    if zero_row is not None:
        packed[zero_row] = 0
    return packed


def bag_lookup(packed: torch.Tensor, bits: int, mode: str, include_last_offset: bool, padding_idx: int | None,
               indices: torch.Tensor, offsets: torch.Tensor | None,
               per_sample_weights: torch.Tensor | None) -> torch.Tensor:
    """``nn.EmbeddingBag`` (mode sum or mean) over ``bits``-bit rows ``packed`` with the padding row
    packed as zeros.

    The ops only sum and have no padding argument. ``padding_idx`` entries add nothing because that
    row is zeros (``nn.EmbeddingBag`` never reads it), and ``mean`` divides each bag's sum by its
    entries not padding (an empty bag stays zeros).
    """
    include_last = include_last_offset
    if indices.dim() == 2:  # fixed-size bags, one per row
        bags, length = indices.shape
        offsets = torch.arange(0, bags * length, length, dtype=indices.dtype)
        indices, include_last = indices.reshape(-1), False
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
    elif offsets is None:
        raise ConfigValidationError("EmbeddingBag: 1-D indices need offsets", field="offsets")
    if mode == "mean" and per_sample_weights is not None:
        raise ConfigValidationError("EmbeddingBag: per_sample_weights need mode='sum'", field="per_sample_weights")
    sums = _lookup(packed, indices, offsets.to(indices.dtype), per_sample_weights, include_last, bits)
    if mode != "mean":
        return sums
    if include_last:
        bounds = offsets
    else:
        bounds = torch.cat([offsets, offsets.new_full((1,), indices.numel())])
    if padding_idx is None:
        counts = bounds.diff()
    else:
        counts = _entries_kept(indices != padding_idx, bounds[:-1], bounds[1:])
    return sums.div_(counts.clamp_(min=1).unsqueeze(1))


class _PackedTable(nn.Module):
    packed_weight: torch.Tensor

    @property
    def num_embeddings(self) -> int:
        """The table's rows, as ``nn.Embedding`` says (what a failed call's ids are checked against)."""
        return self.packed_weight.shape[0]


class Embedding(_PackedTable):
    """``nn.Embedding`` lookups of 8-bit rows: each index is a bag of one, summed."""

    def __init__(self, packed: torch.Tensor, embedding_dim: int):
        super().__init__()
        self.register_buffer("packed_weight", packed)
        self.embedding_dim = embedding_dim

    @classmethod
    def from_float(cls, mod: nn.Embedding, *, engine: str | None = None) -> Embedding:
        return cls(_pack_rows(mod, engine), mod.embedding_dim)

    @classmethod
    def from_context(cls, ctx: KernelContext) -> Embedding:
        return cls.from_float(ctx.module, engine=ctx.engine)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        flat = indices.reshape(-1)
        offsets = torch.arange(flat.numel(), dtype=flat.dtype)
        out = _lookup(self.packed_weight, flat, offsets, None, False)
        return out.reshape(*indices.shape, self.embedding_dim)


class EmbeddingBag(_PackedTable):
    """``nn.EmbeddingBag`` (mode sum or mean) over 8-bit rows (:func:`bag_lookup`); ``max`` has no
    8-bit kernel and is refused at build."""

    def __init__(self, packed: torch.Tensor, mode: str, include_last_offset: bool,
                 padding_idx: int | None = None):
        super().__init__()
        self.register_buffer("packed_weight", packed)
        self.mode, self.include_last_offset, self.padding_idx = mode, include_last_offset, padding_idx

    @property
    def embedding_dim(self) -> int:
        """The row width, as ``nn.EmbeddingBag`` says: each packed row ends in its float32 scale and bias."""
        return self.packed_weight.shape[1] - 8

    @classmethod
    def from_float(cls, mod: nn.EmbeddingBag, *, engine: str | None = None) -> EmbeddingBag:
        if mod.mode not in ("sum", "mean"):
            raise ConstraintViolationError(f"EmbeddingBag: mode={mod.mode!r} has no 8-bit kernel "
                                           f"(sum and mean only)", field="mode", value=mod.mode)
        return cls(_pack_rows(mod, engine, zero_row=mod.padding_idx), mod.mode, mod.include_last_offset,
                   mod.padding_idx)

    @classmethod
    def from_context(cls, ctx: KernelContext) -> EmbeddingBag:
        return cls.from_float(ctx.module, engine=ctx.engine)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return bag_lookup(self.packed_weight, 8, self.mode, self.include_last_offset, self.padding_idx, indices,
                          offsets, per_sample_weights)


def _entries_kept(kept: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """How many entries of each bag (``starts`` to ``ends``) are ``kept``."""
    kept_before = F.pad(kept.cumsum(0), (1, 0))
    return kept_before.index_select(0, ends.long()) - kept_before.index_select(0, starts.long())
