"""QAT embeddings: Embedding and EmbeddingBag with a fake-quantized table (weight-only).

Embedding tables are quantized row by row with float scale/zero point
(``per_channel_affine_float_qparams``), the only scheme the int8 embedding kernels take, so a
qconfig asking for another scheme is rejected up front rather than at convert time.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.errors import ConfigValidationError
from qplug_core.nn.qat_base import (
    build_weight_fake_quant,
    check_float_module,
    resolve_qconfig,
    share_parameter,
)

__all__ = ["Embedding", "EmbeddingBag"]

_FLOAT_QPARAMS = "per_channel_affine_float_qparams"


class _QATEmbedding:
    """Shared from_float/to_float; ``ARG_NAMES`` are the float constructor's keyword arguments."""

    FLOAT_MODULE: ClassVar[type[nn.Module]]
    ARG_NAMES: ClassVar[tuple[str, ...]]
    weight: torch.Tensor
    training: bool

    def _init_fake_quant(self, qconfig: Any) -> None:
        self.qconfig = resolve_qconfig(type(self), None, qconfig)
        self.weight_fake_quant = build_weight_fake_quant(self.qconfig, self.weight)
        scheme = getattr(self.weight_fake_quant, "qscheme", None)
        if scheme is not None and not str(scheme).endswith(_FLOAT_QPARAMS):
            raise ConfigValidationError(
                f"{type(self).__name__} weights need qscheme torch.{_FLOAT_QPARAMS} (one float "
                f"scale/zero point per row), got {scheme}; use a float-qparams weight observer",
                field="qconfig.weight", value=scheme)

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: Any = None) -> Any:
        """The QAT module for ``mod``, sharing its weight."""
        check_float_module(cls, mod)
        qconfig = resolve_qconfig(cls, mod, qconfig)
        qat = cls(**{name: getattr(mod, name) for name in cls.ARG_NAMES}, qconfig=qconfig,
                  device=mod.weight.device, dtype=mod.weight.dtype)
        share_parameter(mod, qat, "weight")
        qat.train(mod.training)
        return qat

    def to_float(self) -> nn.Module:
        """The float module with the trained table."""
        float_mod = self.FLOAT_MODULE(**{name: getattr(self, name) for name in self.ARG_NAMES},
                                      device=self.weight.device, dtype=self.weight.dtype)
        float_mod.weight = nn.Parameter(self.weight.detach().clone())
        float_mod.train(self.training)
        return float_mod


class Embedding(_QATEmbedding, nn.Embedding):
    """QAT Embedding: lookups read the fake-quantized table."""

    FLOAT_MODULE = nn.Embedding
    ARG_NAMES = ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                 "scale_grad_by_freq", "sparse")

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False, *, qconfig: Any = None,
                 device: Any = None, dtype: Any = None):
        nn.Embedding.__init__(self, num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
                              scale_grad_by_freq, sparse, device=device, dtype=dtype)
        self._init_fake_quant(qconfig)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.embedding(input, self.weight_fake_quant(self.weight), self.padding_idx,
                           self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)


class EmbeddingBag(_QATEmbedding, nn.EmbeddingBag):
    """QAT EmbeddingBag: bag reductions over the fake-quantized table."""

    FLOAT_MODULE = nn.EmbeddingBag
    ARG_NAMES = ("num_embeddings", "embedding_dim", "max_norm", "norm_type", "scale_grad_by_freq",
                 "mode", "sparse", "include_last_offset", "padding_idx")

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
                 sparse: bool = False, include_last_offset: bool = False,
                 padding_idx: int | None = None, *, qconfig: Any = None, device: Any = None,
                 dtype: Any = None):
        nn.EmbeddingBag.__init__(self, num_embeddings, embedding_dim, max_norm, norm_type,
                                 scale_grad_by_freq, mode, sparse, None, include_last_offset,
                                 padding_idx, device=device, dtype=dtype)
        self._init_fake_quant(qconfig)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return F.embedding_bag(input, self.weight_fake_quant(self.weight), offsets, self.max_norm,
                               self.norm_type, self.scale_grad_by_freq, self.mode, self.sparse,
                               per_sample_weights, self.include_last_offset, self.padding_idx)
