"""Recurrent sequence classifiers: what dynamic quantization targets (nn.LSTM / nn.GRU + Linear)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from qplug_core.errors import ConfigValidationError, did_you_mean

__all__ = ["RecurrentClassifier", "gru_classifier", "lstm_classifier"]

_RNN_TYPES: dict[str, type[nn.LSTM] | type[nn.GRU]] = {"lstm": nn.LSTM, "gru": nn.GRU}


class RecurrentClassifier(nn.Module):
    """[optional ``embedding``] -> ``rnn`` (batch_first) -> ``fc`` on the last time step.

    Input is ``[B, T]`` token ids when built with a vocabulary, else ``[B, T, input_size]`` floats.
    The RNN's tuple output is indexed rather than unpacked so that torch.fx can trace it.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int, num_classes: int,
                 vocab_size: int | None = None, cell: Literal["lstm", "gru"] = "lstm") -> None:
        super().__init__()
        if cell not in _RNN_TYPES:
            raise ConfigValidationError(
                f"unknown recurrent cell {cell!r}{did_you_mean(cell, _RNN_TYPES)}; "
                f"choose one of {sorted(_RNN_TYPES)}", field="cell", value=cell)
        self.embedding = nn.Embedding(vocab_size, input_size) if vocab_size else None
        self.rnn = _RNN_TYPES[cell](input_size, hidden_size, num_layers, batch_first=True)
        self.fc = nn.Linear(hidden_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        return self.fc(self.rnn(x)[0][:, -1])


def lstm_classifier(input_size: int = 32, hidden_size: int = 64, num_layers: int = 2,
                    num_classes: int = 10, vocab_size: int | None = None) -> RecurrentClassifier:
    """An nn.LSTM classifier; pass ``vocab_size`` to take token ids through an embedding."""
    return RecurrentClassifier(input_size, hidden_size, num_layers, num_classes, vocab_size, "lstm")


def gru_classifier(input_size: int = 32, hidden_size: int = 64, num_layers: int = 2,
                   num_classes: int = 10, vocab_size: int | None = None) -> RecurrentClassifier:
    """The nn.GRU twin of :func:`lstm_classifier`."""
    return RecurrentClassifier(input_size, hidden_size, num_layers, num_classes, vocab_size, "gru")
