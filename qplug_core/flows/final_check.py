"""The model ``qp.quantize`` returns, run against the float model on one calibration batch.

The accuracy target and the convert-time checks score the reference form, layer by layer or
whole; the lowered or delegated model the user gets was compared with nothing float (HF SegFormer
on fbgemm: logits cosine 0.31 against the float model at batch 1 while its report said "target
met", a kernel layout bug). One forward of each of the float model, the final model and its
reference form on the first calibration batch measures both; a final model much worse than its
reference form is a kernel or runtime at fault, and says so.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from qplug_core.errors import warn_user
from qplug_core.flows.pipeline import as_input_tuple, eval_mode
from qplug_core.flows.snapshot import ReferenceSnapshot, snapshot_of
from qplug_core.flows.tags import REPORT
from qplug_core.kernels.base import holding_engine
from qplug_core.kernels.per_token import swap_in_per_token

#: the SQNR recorded for outputs identical to the float model's (JSON has no infinity)
IDENTICAL_DB = 200.0
#: a final model this many dB below its reference form against the float model ...
MAX_GAP_DB = 6.0
#: ... and below this SQNR (its error over 1% of the outputs' energy; above it the reference form
#: is not run) is warned about
NOISY_DB = 20.0


@dataclass(frozen=True)
class Score:
    """The worst float output's cosine and SQNR (dB) against the float model's."""

    cosine: float
    sqnr_db: float

    def __str__(self) -> str:
        return f"cosine {self.cosine:.4f}, SQNR {self.sqnr_db:.1f} dB"


def output_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a model's output, in order: nested tuples, lists and dicts (a Hugging Face
    ``ModelOutput``) flattened."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in output_tensors(item)]
    return []


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise), held within +-:data:`IDENTICAL_DB` (JSON has no infinity)."""
    if noise == 0:
        return IDENTICAL_DB
    return min(IDENTICAL_DB, 10 * math.log10(signal / noise)) if signal > 0 else -IDENTICAL_DB


def score(got: Any, expected: Any) -> Score | None:
    """The worst float output of ``got`` against ``expected`` (None: no float output to score)."""
    scores = []
    for out, ref in zip(output_tensors(got), output_tensors(expected)):
        if not (ref.is_floating_point() and ref.numel() and out.shape == ref.shape):
            continue
        out, ref = out.detach().double().flatten(), ref.detach().double().flatten()
        cosine = float(torch.nn.functional.cosine_similarity(out, ref, dim=0)) if ref.any() else 1.0
        scores.append(Score(cosine, sqnr_db(float(ref.pow(2).sum()), float((out - ref).pow(2).sum()))))
    return min(scores, key=lambda s: s.sqnr_db) if scores else None


def first_batch(calibration_data: Any, model: nn.Module) -> tuple | None:
    """The calibration batch to check on: the first of a list or tuple (the batch ``backend="auto"``
    scores first), a bare tensor; None for a one-pass iterable, which calibration spent."""
    if isinstance(calibration_data, torch.Tensor):
        return (calibration_data,)
    if isinstance(calibration_data, (list, tuple)) and calibration_data:
        return as_input_tuple(calibration_data[0], model)
    return None


def check_final_model(qmodel: nn.Module, model: nn.Module, calibration_data: Any) -> None:
    """Score ``qmodel`` against the float ``model`` on one calibration batch, and its reference form
    too where ``qmodel`` is below :data:`NOISY_DB`; record both in its report (``final_check``)
    and warn when the final model is much worse than its reference form."""
    report = qmodel.meta.get(REPORT) if isinstance(qmodel, fx.GraphModule) else None
    snapshot = snapshot_of(qmodel)
    if report is None or snapshot is None or not isinstance(model, nn.Module):
        return
    batch = first_batch(calibration_data, model)
    if batch is None:
        report.notes.append("the final model was not run against the float model: the calibration data "
                            "was a one-pass iterable (pass a list to have it checked)")
        return
    with torch.no_grad():
        with contextlib.ExitStack() as modes:
            with contextlib.suppress(NotImplementedError):  # torch's exported modules have no mode
                modes.enter_context(eval_mode(model))  # as it was calibrated: dropout off
            expected = model(*_fresh(batch))
        with holding_engine():
            final = score(qmodel(*_fresh(batch)), expected)
        # the reference form (rebuilt, and slower than both) only where the final model is noisy
        # enough for it to matter: over half of the check's time on resnet18
        reference = (score(_reference_form(snapshot)(*_fresh(batch)), expected)
                     if final and final.sqnr_db < NOISY_DB else None)
    if final is None:
        return
    report.final_check = {"cosine": final.cosine, "sqnr_db": final.sqnr_db,
                          "reference_cosine": None if reference is None else reference.cosine,
                          "reference_sqnr_db": None if reference is None else reference.sqnr_db}
    if reference is not None and final.sqnr_db < reference.sqnr_db - MAX_GAP_DB:
        warn_user(f"backend {report.backend!r}: the quantized model is {reference.sqnr_db - final.sqnr_db:.1f} dB "
                  f"worse than its reference form against the float model on a calibration batch ({final}; "
                  f"reference form: {reference}): a kernel or runtime of {report.backend!r} computes otherwise "
                  "than the reference form; qp.compare(model, qmodel, inputs) shows the layer where it starts")


def _fresh(batch: tuple) -> tuple:
    """A copy of the user's calibration batch for each run: a model that writes into its input
    must not change the user's data."""
    return tuple(value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value) for value in batch)


def _reference_form(snapshot: ReferenceSnapshot) -> fx.GraphModule:
    """The reference form the final model was made from: with its per-token layers simulated, as
    ``backend="reference"`` runs them (without, those layers stay float: MiniLM's reference form
    read 8.7 dB better than the fbgemm model made from it, a false alarm)."""
    gm = snapshot.graph_module
    if snapshot.per_token_layers:
        swap_in_per_token(gm, list(snapshot.per_token_layers), simulate=True)
    return gm


__all__ = ["Score", "check_final_model", "first_batch", "output_tensors", "score", "sqnr_db"]
