"""Calling the user's model on a calibration batch, with qplug's error when the batch does not fit.

The data-aware weight-only algorithms and W8A8 run the user's own model (not a traced graph) on
the calibration batches; a float tensor for a language model or a token id past its vocabulary
would otherwise surface as the embedding's own error from deep inside the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from qplug_core.errors import QplugError, notify
from qplug_core.flows.checks import check_calibration_data
from qplug_core.flows.steps import batch_does_not_fit

#: the inputs that give an encoder-decoder's decoder its tokens (Hugging Face models shift ``labels``
#: right into ``decoder_input_ids`` when none are given)
_DECODER_INPUTS = ("decoder_input_ids", "decoder_inputs_embeds", "labels")


def calibration_batches(calibration: Any, model: nn.Module) -> Iterable[Any]:
    """The batches of ``calibration``: a bare tensor is one batch, as ``qp.calibrate`` takes it
    (iterating it would call the model on each of its rows), and so is a dict of model inputs (a
    tokenizer's ``BatchEncoding``: iterating it gives its keys); ``None`` is none. Anything else
    that is not an iterable raises :class:`CalibrationError`, as ``qp.quantize`` does. An
    encoder-decoder's batches without decoder inputs get its start token (:func:`decoder_started`)."""
    if calibration is None:
        return ()
    if isinstance(calibration, torch.Tensor) or hasattr(calibration, "keys"):
        calibration = [calibration]
    else:
        check_calibration_data(calibration, "calibration")
    if _decoder_start(model) is None:
        return calibration
    started = _started(model, calibration)
    return list(started) if isinstance(calibration, (list, tuple)) else started


def _started(model: nn.Module, batches: Iterable[Any]) -> Iterator[Any]:
    """Each batch :func:`decoder_started`, saying so once."""
    told = False
    for batch in batches:
        given = decoder_started(model, batch)
        if given is not batch and not told:
            told = True
            notify(f"{type(model).__name__} is an encoder-decoder and the calibration batches have no decoder "
                   f"inputs: each is given decoder_input_ids=[[{_decoder_start(model)}]] (the decoder start "
                   "token), as generate() starts the decoder; give decoder_input_ids in each dict batch to "
                   "calibrate on longer decoder inputs")
        yield given


def _decoder_start(model: nn.Module) -> int | None:
    """The token an encoder-decoder's ``generate()`` starts its decoder with; None for other models."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False):
        return None
    start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    start = getattr(config, "decoder_start_token_id", None) if start is None else start
    return start if isinstance(start, int) else None


def decoder_started(model: nn.Module, batch: Any) -> Any:
    """``batch`` as keyword inputs with ``decoder_input_ids=[[start]]`` per row, for an encoder-decoder
    whose batch gives its decoder nothing (Whisper's ``model(input_features)`` raised inside the
    decoder); else ``batch`` itself."""
    start = _decoder_start(model)
    inputs = None if start is None else keyword_inputs(model, batch)
    if inputs is None or any(inputs.get(name) is not None for name in _DECODER_INPUTS):
        return batch
    rows = next((value.shape[0] for value in inputs.values() if isinstance(value, torch.Tensor) and value.dim()),
                None)
    if rows is None:
        return batch
    return {**inputs, "decoder_input_ids": torch.full((rows, 1), start, dtype=torch.long)}


def keyword_inputs(model: nn.Module, batch: Any) -> dict[str, Any] | None:
    """``batch`` (a dict, a tuple of positional inputs or one tensor) as the keyword inputs
    ``model``'s forward binds it to; None where it does not bind."""
    if hasattr(batch, "keys"):
        return dict(batch)
    positional = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    try:
        return dict(inspect.signature(model.forward).bind_partial(*positional).arguments)
    except (TypeError, ValueError):
        return None


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
                                      f"positional inputs or dicts of keyword inputs{_decoder_advice(model)}"
                                 ) from error


def _decoder_advice(model: nn.Module) -> str:
    """For an encoder-decoder: the dict keys a batch needs."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return ""
    main = getattr(model, "main_input_name", "input_ids")
    return (f"; {type(model).__name__} is an encoder-decoder: give dicts "
            f"{{{main!r}: ..., 'decoder_input_ids': ...}}")


def _token_hint(model: nn.Module, batch: Any) -> str:
    """What is wrong with a token batch, when the model takes token ids first (``forward(input_ids,
    ...)``) and has input embeddings to say it: Whisper has embeddings too, its decoder's, but takes
    float ``input_features``."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else batch
    get_embeddings = getattr(model, "get_input_embeddings", None)
    if not isinstance(ids, torch.Tensor) or not callable(get_embeddings) or not _takes_tokens_first(model):
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


def _takes_tokens_first(model: nn.Module) -> bool:
    try:
        first = next(iter(inspect.signature(model.forward).parameters), None)
    except (TypeError, ValueError):
        return False
    return first == "input_ids"
