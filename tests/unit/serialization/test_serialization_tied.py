"""Tied weights in a static int8 file: one int8 table where the quantized values are the same,
two where the modules got different qparams (an LLM's quint8 embedding and qint8 head)."""

from __future__ import annotations

import torch
from safetensors import safe_open
from serialization_testkit import EmbeddingBagOfWords, batches, bits, quantize
from torch import nn

from qplug_core.serialization import load, save
from qplug_core.serialization.files import read_artifact_file


class TiedLinears(nn.Module):
    """Two linears sharing one weight (an encoder and its tied decoder): quantized alike."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.encode = nn.Linear(dim, dim)
        self.decode = nn.Linear(dim, dim)
        self.decode.weight = self.encode.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(torch.relu(self.encode(x)))


class TiedEmbeddingHead(EmbeddingBagOfWords):
    """An input embedding tied to an output head, as in most LLMs (tie_word_embeddings=True)."""

    def __init__(self, vocabulary: int = 50, dim: int = 16):
        super().__init__(vocabulary, dim)
        self.head = nn.Linear(dim, vocabulary, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens))


def int8_keys(path) -> list[str]:
    with safe_open(str(path), framework="pt") as file:
        return [key for key in file.keys() if file.get_slice(key).get_dtype() in ("I8", "U8")]


def test_a_tied_weight_quantized_alike_is_stored_and_read_once(tmp_path):
    model = quantize(TiedLinears(), (4, 64))
    path = save(model, tmp_path / "tied.safetensors")
    untied = TiedLinears()
    untied.decode.weight = nn.Parameter(untied.encode.weight.detach().flip(0))  # other values
    separate = save(quantize(untied, (4, 64)), tmp_path / "untied.safetensors")

    assert len(int8_keys(path)) == 1
    assert len(int8_keys(separate)) == 2
    assert separate.stat().st_size - path.stat().st_size >= 64 * 64  # one 64 x 64 int8 table fewer
    loaded = load(path)
    with torch.no_grad():
        for (x,) in batches((3, 64), seed=1):
            assert torch.equal(bits(loaded(x)), bits(model(x)))


def test_tied_embedding_and_head_with_different_qparams_keep_both_tables(tmp_path):
    model = quantize(TiedEmbeddingHead(), (2, 5), tokens=50)
    path = save(model, tmp_path / "lm.safetensors")

    _, tensors = read_artifact_file(path)
    embedding, head = tensors["embedding.module.weight"], tensors["head.module.weight"]
    assert (embedding.dtype, head.dtype) == (torch.uint8, torch.int8)  # per-row quint8, per-channel qint8
    loaded = load(path)
    with torch.no_grad():
        for (tokens,) in batches((3, 5), tokens=50, seed=1):
            assert torch.equal(bits(loaded(tokens)), bits(model(tokens)))
