"""The model ``qp.quantize`` (or ``qp.convert_fx``) returns, run against the float model on one
calibration batch.

The accuracy target and the convert-time checks score the reference form, layer by layer or
whole; the lowered or delegated model the user gets was compared with nothing float (HF SegFormer
on fbgemm: logits cosine 0.31 against the float model at batch 1 while its report said "target
met", a kernel layout bug). The final model runs once on the first calibration batch, against the
float output calibration computed for it (:mod:`qplug_core.flows.first_batch`; the float model runs
again only where none was kept), and its reference form too where the final model is noisy; a final
model much worse than its reference form is a kernel or runtime at fault. The kernel contract then
runs on that batch: the kernels that break it there keep their regions in reference form, and the
model so mended is checked again (:func:`mended`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from qplug_core.errors import warn_user
from qplug_core.flows.first_batch import FirstBatch, fresh, is_recording, take
from qplug_core.flows.pipeline import as_input_tuple, eval_mode
from qplug_core.flows.refinish import finish_on
from qplug_core.flows.report import QuantizationReport
from qplug_core.flows.snapshot import ReferenceSnapshot, snapshot_of
from qplug_core.flows.tags import REPORT, SNAPSHOT, TARGET
from qplug_core.kernels.per_token import swap_in_per_token
from qplug_core.registry.backends import get_backend

#: the SQNR recorded for outputs identical to the float model's (JSON has no infinity)
IDENTICAL_DB = 200.0
#: a final model this many dB below its reference form against the float model ...
MAX_GAP_DB = 6.0
#: ... and below this SQNR (its error over 1% of the outputs' energy; above it the reference form
#: is not run) is warned about
NOISY_DB = 20.0
#: a returned model below this cosine against the float model, with no accuracy target applied,
#: is warned about (zoo MobileNetV2 at random init scored 0.00, its outputs under one int8 step)
LOW_COSINE = 0.9


#: what scores a derived output of a model's first output on its batch (the pooled embedding an
#: accuracy target scores a sentence encoder by): the output, and the batch; None where it does not apply
Derived = Callable[[torch.Tensor, tuple], "torch.Tensor | None"]


@dataclass(frozen=True)
class Score:
    """The worst float output's cosine and SQNR (dB) against the float model's, and its name."""

    cosine: float
    sqnr_db: float
    output: str = "output"

    def __str__(self) -> str:
        return f"cosine {self.cosine:.4f}, SQNR {self.sqnr_db:.1f} dB"


def named_outputs(value: Any, name: str = "output") -> list[tuple[str, torch.Tensor]]:
    """The tensors of a model's output with their names, in order: nested tuples and lists by
    index (``output[1]``), dicts (a Hugging Face ``ModelOutput``) by key (``last_hidden_state``)."""
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if isinstance(value, Mapping):
        return [item for key, v in value.items()
                for item in named_outputs(v, str(key) if name == "output" else f"{name}.{key}")]
    if isinstance(value, (tuple, list)):
        return [item for i, v in enumerate(value) for item in named_outputs(v, f"{name}[{i}]")]
    return []


def output_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a model's output, in order (see :func:`named_outputs`)."""
    return [tensor for _, tensor in named_outputs(value)]


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise), held within +-:data:`IDENTICAL_DB` (JSON has no infinity)."""
    if noise == 0:
        return IDENTICAL_DB
    return min(IDENTICAL_DB, 10 * math.log10(signal / noise)) if signal > 0 else -IDENTICAL_DB


def score(got: Any, expected: Any) -> Score | None:
    """The worst float output of ``got`` against ``expected`` (None: no float output to score)."""
    scores = []
    for (name, ref), out in zip(named_outputs(expected), output_tensors(got)):
        if not (ref.is_floating_point() and ref.numel() and out.shape == ref.shape):
            continue
        out, ref = out.detach().double().flatten(), ref.detach().double().flatten()
        cosine = float(torch.nn.functional.cosine_similarity(out, ref, dim=0)) if ref.any() else 1.0
        scores.append(Score(cosine, sqnr_db(float(ref.pow(2).sum()), float((out - ref).pow(2).sum())), name))
    return min(scores, key=lambda s: s.sqnr_db) if scores else None


def first_batch(calibration_data: Any, model: nn.Module) -> tuple | None:
    """The calibration batch to check on: the first of a list or tuple (the batch ``backend="auto"``
    scores first), a bare tensor; None for a one-pass iterable, which calibration spent."""
    if isinstance(calibration_data, torch.Tensor):
        return (calibration_data,)
    if isinstance(calibration_data, (list, tuple)) and calibration_data:
        return as_input_tuple(calibration_data[0], model)
    return None


def check_final_model(qmodel: nn.Module, model: Any, calibration_data: Any, kept: FirstBatch | None = None,
                      derived: tuple[str, Derived] | None = None) -> nn.Module:
    """``qp.quantize``'s check of the model it returns: against ``kept`` (the first calibration
    batch and the float output calibration computed for it), else against the float ``model``
    (an ``nn.Module`` or ``ExportedProgram``) run on the first batch of ``calibration_data``.
    ``derived`` (its name, and how to compute it) is a derived output the accuracy target scored,
    reported beside. Returns ``qmodel``, or the model :func:`mended` made of it."""
    report = qmodel.meta.get(REPORT) if isinstance(qmodel, fx.GraphModule) else None
    if report is None or snapshot_of(qmodel) is None:
        return qmodel
    float_model = model.module() if isinstance(model, torch.export.ExportedProgram) else model
    if kept is None:
        batch = first_batch(calibration_data, float_model) if isinstance(float_model, nn.Module) else None
        if batch is None:
            report.notes.append("the final model was not run against the float model: the calibration data "
                                "was a one-pass iterable (pass a list to have it checked)")
            return qmodel
        kept = FirstBatch(batch, None)
    if kept.output is None:  # the user's float model on the batch, where calibration's output is not its own
        kept = dataclasses.replace(kept, output=_float_output(float_model, kept))
    return check_against(qmodel, kept, derived)


def check_converted(qmodel: fx.GraphModule) -> nn.Module:
    """``qp.convert_fx``'s check of the model it returns, on the observed model's first call
    (:mod:`qplug_core.flows.first_batch`); none inside ``qp.quantize``, which checks the model it
    returns itself. Returns ``qmodel``, or the model :func:`mended` made of it."""
    kept = take(qmodel)
    if is_recording():
        return qmodel
    report = qmodel.meta.get(REPORT)
    if kept is None:
        if report is not None and report.mode != "dynamic":
            report.notes.append("the final model was not run against the float model: the observed model "
                                "recorded no call (a QAT model's outputs are not float; calibrate by running "
                                "the observed model to have it checked)")
        return qmodel
    if kept.output is None:
        if report is not None:
            report.notes.append(f"the final model was not run against the float model: {kept.unkept}, so its "
                                "float output on the first calibration batch was not kept; "
                                "qp.compare(model, qmodel, inputs) scores it")
        return qmodel
    return check_against(qmodel, kept)


def _float_output(model: Any, kept: FirstBatch) -> Any:
    with torch.no_grad(), contextlib.ExitStack() as modes:
        if isinstance(model, nn.Module):  # not a method given to qp.quantize
            with contextlib.suppress(NotImplementedError):  # torch's exported modules have no mode
                modes.enter_context(eval_mode(model))  # as it was calibrated: dropout off
        return kept.call(model)


def check_against(qmodel: fx.GraphModule, kept: FirstBatch, derived: tuple[str, Derived] | None = None
                  ) -> nn.Module:
    """Score ``qmodel`` against ``kept``'s float output on its inputs, and its reference form too
    where ``qmodel`` is below :data:`NOISY_DB`; record both in its report (``final_check``). A
    final model much worse than its reference form is :func:`mended` where its kernels break the
    contract on this batch, and warned about either way. Returns the model to use."""
    report, snapshot = qmodel.meta.get(REPORT), snapshot_of(qmodel)
    if report is None or snapshot is None:
        return qmodel
    final, reference, got = _scores(qmodel, snapshot, kept)
    if final is None:
        return qmodel
    _record(report, final, reference, derived and _derived_score(derived, got, kept))
    if reference is None or final.sqnr_db >= reference.sqnr_db - MAX_GAP_DB:
        _warn_if_far(qmodel, report, final)
        return qmodel
    gap = (f"the quantized model was {reference.sqnr_db - final.sqnr_db:.1f} dB worse than its reference form "
           f"against the float model on a calibration batch ({final}; reference form: {reference})")
    better = mended(qmodel, snapshot, report, kept.inputs)
    if better is None:
        warn_user(f"backend {report.backend!r}: {gap}: a kernel or runtime of {report.backend!r} computes "
                  f"otherwise than the reference form; qp.compare(model, qmodel, inputs) shows the layer where "
                  "it starts")
        return qmodel
    model, kept_layers = better
    new_report = model.meta[REPORT]
    now, _, got = _scores(model, snapshot, kept, reference_too=False)
    if now is not None:
        _record(new_report, now, reference, derived and _derived_score(derived, got, kept))
    shown = ", ".join(kept_layers[:4]) + (f" and {len(kept_layers) - 4} more" if len(kept_layers) > 4 else "")
    warn_user(f"backend {report.backend!r}: {gap}: its kernels for {shown} broke the kernel contract on that "
              f"batch and run in reference form now ({now if now is not None else 'not scored'}); the "
              "report says why each")
    return model


def _warn_if_far(qmodel: fx.GraphModule, report: QuantizationReport, final: Score) -> None:
    """Say so where the model returned is far from the float model and no accuracy target decided
    it (the report's line alone was missed)."""
    if final.cosine >= LOW_COSINE or TARGET in qmodel.meta:
        return
    warn_user(f"backend {report.backend!r}: the quantized model does not reproduce the float model on the first "
              f"calibration batch ({final.output}: {final}) and no accuracy target was applied: "
              "qp.quantize(..., target=qp.Target(cosine=0.99)) keeps float the layers it takes, "
              "qp.compare(model, qmodel, inputs) shows the layer where the error starts")


def _scores(qmodel: fx.GraphModule, snapshot: ReferenceSnapshot, kept: FirstBatch, *, reference_too: bool = True
            ) -> tuple[Score | None, Score | None, Any]:
    """The final model's score, its reference form's (only where the final model is noisy enough
    for it to matter: that run was over half of the check's time on resnet18), and its output."""
    with torch.no_grad():
        got = kept.call(qmodel)
        final = score(got, kept.output)
        reference = (score(kept.call(_reference_form(snapshot)), kept.output)
                     if reference_too and final and final.sqnr_db < NOISY_DB else None)
    return final, reference, got


def _derived_score(derived: tuple[str, Derived], got: Any, kept: FirstBatch) -> tuple[str, float] | None:
    """``derived``'s name and the mean cosine over the batch's samples of the final model's
    derived output against the float model's (None where it does not apply)."""
    name, compute = derived
    outs, refs = output_tensors(got), output_tensors(kept.output)
    if not (outs and refs) or outs[0].shape != refs[0].shape:
        return None
    ours, theirs = compute(outs[0], kept.inputs), compute(refs[0], kept.inputs)
    if ours is None or theirs is None:
        return None
    cosines = torch.nn.functional.cosine_similarity(ours.double().flatten(1), theirs.double().flatten(1), dim=1)
    return name, float(cosines.mean())


def _record(report: QuantizationReport, final: Score, reference: Score | None,
            derived: tuple[str, float] | None) -> None:
    report.final_check = {"output": final.output, "cosine": final.cosine, "sqnr_db": final.sqnr_db,
                          "reference_cosine": None if reference is None else reference.cosine,
                          "reference_sqnr_db": None if reference is None else reference.sqnr_db}
    if derived is not None:
        report.final_check["derived"], report.final_check["derived_cosine"] = derived


def mended(qmodel: fx.GraphModule, snapshot: ReferenceSnapshot, report: QuantizationReport, inputs: tuple
           ) -> tuple[fx.GraphModule, list[str]] | None:
    """``qmodel`` finished again from its reference form with the kernel contract run on ``inputs``
    (where the final model went wrong): the regions it kept in reference form stay so, and those
    whose kernels (or compiled partitions) break the contract on ``inputs`` join them. Returns that
    model and the regions it newly keeps, or None (no kernel breaks it there, or lowering again failed)."""
    try:
        backend = get_backend(report.backend)
        model = finish_on(snapshot, backend, qmodel, keep_reference=dict(report.reference),
                          keep_regions=dict(report.kept_regions), checked_on=fresh(inputs))
    except Exception:  # noqa: BLE001 - the mend is a second chance: the model checked stays as it is
        return None
    new = model.meta[REPORT]
    kept_layers = [*(a for a in new.reference if a not in report.reference),
                   *(r for r in new.kept_regions if r not in report.kept_regions)]
    if not kept_layers:
        return None
    for reasons in (new.reference, new.kept_regions):  # the contract ran on the batch, not the example
        for name in kept_layers:
            if name in reasons:
                reasons[name] = reasons[name].replace("on the example inputs", "on the first calibration batch")
    for key, value in qmodel.meta.items():  # what the flows added after convert (auto's ranking, ...)
        model.meta.setdefault(key, value)
    if snapshot.target_rungs:
        model.meta[SNAPSHOT] = dataclasses.replace(model.meta[SNAPSHOT], target_rungs=snapshot.target_rungs)
    new.auto, new.recipe = report.auto, report.recipe
    new.notes = [*report.notes, *(note for note in new.notes if note not in report.notes)]
    return model, kept_layers


def _reference_form(snapshot: ReferenceSnapshot) -> fx.GraphModule:
    """The reference form the final model was made from: with its per-token layers simulated, as
    ``backend="reference"`` runs them (without, those layers stay float: MiniLM's reference form
    read 8.7 dB better than the fbgemm model made from it, a false alarm)."""
    gm = snapshot.graph_module
    if snapshot.per_token_layers:
        swap_in_per_token(gm, list(snapshot.per_token_layers), simulate=True)
    return gm


__all__ = ["LOW_COSINE", "Derived", "Score", "check_against", "check_converted", "check_final_model", "first_batch", "mended", "named_outputs",
           "output_tensors", "score", "sqnr_db"]
