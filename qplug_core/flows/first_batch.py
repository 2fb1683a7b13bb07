"""The first calibration batch and the float output calibration computed for it, for the final check.

An observed model computes what the float model computes (its observers only watch), so the
output calibration already produced for its first batch is the float output the final check
(:mod:`qplug_core.flows.final_check`) scores the converted model against: kept, the check costs one
forward of the converted model instead of one more of the float model too. Not where a step before
prepare changed the float graph's function (:data:`~qplug_core.flows.tags.FLOAT_EDITED`: bias
correction of ``recipe="dfq"``; ResNet-18 scored 35.3 dB against it, 39.0 dB against the user's
model), nor where the batch and output pass :data:`KEEP_LIMIT` (an LM head's logits held 500 MiB):
there only the inputs are kept and the float model runs again.

The observed model records its first call itself (``qp.calibrate`` or the user's own loop, as
torch.ao's flow calibrates), into its meta (``qp.convert_fx`` checks the model it returns on it) and,
while ``qp.quantize`` runs, into its recording too: its algorithms convert models calibrated from
copied observers, and ``backend="auto"`` calibrates its bases in nested calls; the first record made
inside wins. The inputs are copied before the forward (a model may write into its input), the
outputs after it (nothing later may change them); then the hooks go. A QAT model's output is
fake-quantized, not float: it records nothing. Convert takes the record off the observed model
and the check off the converted one: neither holds the user's data after.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from qplug_core.flows.tags import FIRST_BATCH, FIRST_CALL_INPUTS, FLOAT_EDITED

#: the most bytes of tensors a record holds (inputs and output): above it the output is not kept
KEEP_LIMIT = 64 * 2**20


@dataclass(frozen=True, eq=False)
class FirstBatch:
    """``inputs`` and ``keywords`` (copied) and the float ``output`` (tensors copied; a mapping
    such as a Hugging Face ``ModelOutput`` as a dict, sequences as lists), or None and why
    (``unkept``): the float model must run again for it."""

    inputs: tuple
    output: Any
    keywords: dict[str, Any] = field(default_factory=dict)
    unkept: str = ""

    def call(self, model: Any) -> Any:
        """``model`` run on a fresh copy of the inputs."""
        return model(*fresh(self.inputs), **{key: fresh((value,))[0] for key, value in self.keywords.items()})

    def __deepcopy__(self, memo: dict) -> FirstBatch:  # convert's copy of the observed model shares it
        return self


_RECORDING: contextvars.ContextVar[list[FirstBatch] | None] = contextvars.ContextVar("first_batch", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[FirstBatch]]:
    """Collect the first record made inside (into the open recording if there is one)."""
    outer = _RECORDING.get()
    if outer is not None:
        yield outer
        return
    found: list[FirstBatch] = []
    token = _RECORDING.set(found)
    try:
        yield found
    finally:
        _RECORDING.reset(token)


def is_recording() -> bool:
    """Whether a ``qp.quantize`` call is running (it checks the model it returns itself)."""
    return _RECORDING.get() is not None


def fresh(batch: tuple) -> tuple:
    """A copy of a batch: a model that writes into its input must not change the user's data."""
    return tuple(value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value) for value in batch)


def watch(model: fx.GraphModule) -> None:
    """Record the first call of ``model`` (a static observed graph) once it returns."""
    model.register_forward_pre_hook(_before, with_kwargs=True)
    model.register_forward_hook(_after, with_kwargs=True)


def unwatch(model: fx.GraphModule) -> None:
    """Remove the hooks of :func:`watch` (from convert's copy of an observed model, too)."""
    for hooks, with_kwargs in ((model._forward_pre_hooks, model._forward_pre_hooks_with_kwargs),
                               (model._forward_hooks, model._forward_hooks_with_kwargs)):
        for key in [key for key, hook in hooks.items() if hook in (_before, _after)]:
            del hooks[key]
            with_kwargs.pop(key, None)
    model.meta.pop(FIRST_CALL_INPUTS, None)


def _before(model: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> None:
    if nbytes((args, kwargs)) <= KEEP_LIMIT:  # else nothing is kept: the check reads the calibration data
        model.meta[FIRST_CALL_INPUTS] = (fresh(args), {key: fresh((value,))[0] for key, value in kwargs.items()})


def _after(model: fx.GraphModule, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    pending = model.meta.get(FIRST_CALL_INPUTS)
    unwatch(model)
    if pending is None:
        return
    unkept = (f"the float graph calibrated was changed before prepare ({model.meta[FLOAT_EDITED]})"
              if model.meta.get(FLOAT_EDITED) else
              f"its output is over {KEEP_LIMIT / 2**20:g} MiB" if nbytes((pending, output)) > KEEP_LIMIT else "")
    record = FirstBatch(pending[0], None if unkept else _copied(output), pending[1], unkept)
    model.meta[FIRST_BATCH] = record
    found = _RECORDING.get()
    if found is not None and not found:
        found.append(record)


def take(model: Any) -> FirstBatch | None:
    """The record kept in ``model``, removed (a converted model does not hold the user's data)."""
    record = getattr(model, "meta", {}).pop(FIRST_BATCH, None) if isinstance(model, fx.GraphModule) else None
    return record if isinstance(record, FirstBatch) else None


def nbytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (nested tuples, lists and mappings)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(nbytes(item) for item in value.values())
    if isinstance(value, (tuple, list)):
        return sum(nbytes(item) for item in value)
    return 0


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return [_copied(item) for item in value]
    return None


__all__ = ["KEEP_LIMIT", "FirstBatch", "fresh", "nbytes", "is_recording", "recording", "take", "unwatch", "watch"]
