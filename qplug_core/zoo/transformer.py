"""A small BERT-style sentence encoder written with plain ``nn.Linear``/``LayerNorm``/``GELU``.

Attention is spelled out (q/k/v/out projections, ``q @ k^T / sqrt(d)``, BERT's additive -10000
mask, softmax, dropout) rather than using ``nn.MultiheadAttention``, so that every matmul and
projection is a separate, quantizable node in a ``torch.fx`` graph. Submodule names follow
Hugging Face's ``BertModel`` (``encoder.layer.0.attention.self.query``...), and ``forward`` has no
data-dependent control flow, so ``torch.fx.symbolic_trace`` captures it as is.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qplug_core.errors import ConfigValidationError
from qplug_core.zoo._rng import seeded

__all__ = ["BertEncoder", "bert_encoder", "make_realistic_bert", "mean_pool"]

#: the additive bias BERT puts on attention scores of padding positions
MASK_BIAS = -10000.0


class BertEmbeddings(nn.Module):
    """Word + learned position embeddings, then LayerNorm and dropout (no token types)."""

    def __init__(self, vocab_size: int, hidden: int, max_len: int, dropout: float) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden)
        self.position_embeddings = nn.Embedding(max_len, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    """Multi-head scaled dot-product attention over explicit q/k/v projections."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = heads
        self.head_dim = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), x.size(1), self.num_heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        q = self._split_heads(self.query(x))
        k = self._split_heads(self.key(x))
        v = self._split_heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + mask_bias
        probs = self.dropout(torch.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), -1)


class BertResidualOutput(nn.Module):
    """dense -> dropout -> LayerNorm(x + residual): BERT's "output" sub-block (attention, FFN)."""

    def __init__(self, in_features: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.self = BertSelfAttention(hidden, heads, dropout)
        self.output = BertResidualOutput(hidden, hidden, dropout)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask_bias), x)


class BertIntermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, dropout: float) -> None:
        super().__init__()
        self.attention = BertAttention(hidden, heads, dropout)
        self.intermediate = BertIntermediate(hidden, intermediate)
        self.output = BertResidualOutput(intermediate, hidden, dropout)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask_bias)
        return self.output(self.intermediate(x), x)


class BertEncoderStack(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, intermediate: int,
                 dropout: float) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(hidden, heads, intermediate, dropout) for _ in range(layers))

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, mask_bias)
        return x


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average token states over real (mask == 1) positions: the sentence-transformers pooling."""
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


class BertEncoder(nn.Module):
    """``forward(input_ids [B, T], attention_mask [B, T]) -> sentence embedding [B, hidden]``."""

    def __init__(self, vocab_size: int = 1000, hidden: int = 128, layers: int = 2, heads: int = 4,
                 intermediate: int = 512, max_len: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(vocab_size, hidden, max_len, dropout)
        self.encoder = BertEncoderStack(layers, hidden, heads, intermediate, dropout)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        """BERT's init: N(0, 0.02) for weights and embeddings, zero biases, LayerNorm 1/0."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask_bias = (1.0 - attention_mask.to(torch.float32)[:, None, None, :]) * MASK_BIAS
        hidden = self.encoder(self.embeddings(input_ids), mask_bias)
        return mean_pool(hidden, attention_mask)


def bert_encoder(vocab_size: int = 1000, hidden: int = 128, layers: int = 2, heads: int = 4,
                 intermediate: int = 512, max_len: int = 64) -> BertEncoder:
    """A BERT-style encoder with BERT's N(0, 0.02) random init (activations have no outliers)."""
    if hidden % heads:
        raise ConfigValidationError(
            f"hidden={hidden} is not divisible by heads={heads}; pick heads that divide hidden",
            field="heads", value=heads)
    return BertEncoder(vocab_size, hidden, layers, heads, intermediate, max_len)


def make_realistic_bert(seed: int = 0, outlier_dims: tuple[int, ...] = (7, 77),
                        outlier_scale: float = 4.0, **kw: int) -> BertEncoder:
    """A deterministic encoder whose activations have trained BERT's outlier structure.

    Trained BERTs carry a few hidden dimensions where every LayerNorm has a large weight and
    bias (Kovaleva et al. 2021, "BERT Busters"; Dettmers et al. 2022, "LLM.int8()"), so those
    channels are 10-20x larger than the rest in every residual stream and per-tensor int8
    loses the small channels. Rather than train (slow and not what matters for quantization),
    this builds ``bert_encoder(**kw)`` under ``seed`` and multiplies each LayerNorm's weight by
    ``outlier_scale`` on ``outlier_dims`` (bias ``outlier_scale / 4``); the default 4.0 gives
    outlier channels about 10x the largest other activation after the first layer, as in BERT-base.
    The model is returned in eval mode.
    """
    with seeded(seed):
        model = bert_encoder(**kw)
    dims = [d for d in outlier_dims if d < model.embeddings.LayerNorm.normalized_shape[0]]
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight[dims] *= outlier_scale
                m.bias[dims] = outlier_scale / 4
    return model.eval()
