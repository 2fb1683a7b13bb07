"""Calling the user's model on a calibration batch, with qplug's error when the batch does not fit.

The data-aware weight-only algorithms and W8A8 run the user's own model (not a traced graph) on
the calibration batches; a float tensor for a language model or a token id past its vocabulary
would otherwise surface as the embedding's own error from deep inside the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from qplug_core.errors import QplugError
from qplug_core.flows.checks import check_calibration_data
from qplug_core.flows.steps import batch_does_not_fit


def calibration_batches(calibration: Any) -> Iterable[Any]:
    """The batches of ``calibration``: a bare tensor is one batch, as ``qp.calibrate`` takes it
    (iterating it would call the model on each of its rows), and so is a dict of model inputs (a
    tokenizer's ``BatchEncoding``: iterating it gives its keys); ``None`` is none. Anything else
    that is not an iterable raises :class:`CalibrationError`, as ``qp.quantize`` does."""
    if calibration is None:
        return ()
    if isinstance(calibration, torch.Tensor) or hasattr(calibration, "keys"):
        return [calibration]
    check_calibration_data(calibration, "calibration")
    return calibration


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list, else ``model(batch)``;
    returns what the model returned."""
    if hasattr(batch, "keys"):  # a dict, or a tokenizer's BatchEncoding
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def run_batch(model: nn.Module, batch: Any, index: int) -> None:
    """:func:`call_model` on calibration batch ``index``; an error of the model's becomes an
    :class:`InputMismatchError` naming the batch (and what is wrong with a token batch)."""
    try:
        call_model(model, batch)
    except QplugError:
        raise
    except Exception as error:
        raise batch_does_not_fit(index, error, detail=_token_hint(model, batch),
                                 give="batches the model's forward takes: token id tensors, tuples of "
                                      "positional inputs or dicts of keyword inputs") from error


def _token_hint(model: nn.Module, batch: Any) -> str:
    """What is wrong with a token batch, when the model has input embeddings to say it."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else batch
    get_embeddings = getattr(model, "get_input_embeddings", None)
    if not isinstance(ids, torch.Tensor) or not callable(get_embeddings):
        return ""
    try:
        vocabulary = get_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        return ""
    if ids.is_floating_point():
        return f" (the batch is {str(ids.dtype).removeprefix('torch.')}; the model takes token ids, torch.long)"
    if ids.numel() and (int(ids.max()) >= vocabulary or int(ids.min()) < 0):
        return (f" (the batch holds token ids from {int(ids.min())} to {int(ids.max())}; the vocabulary "
                f"has {vocabulary})")
    return ""
