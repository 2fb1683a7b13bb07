"""SmoothQuant folded into the model's own weights, so smoothing costs nothing at run time.

For a linear ``y = x W^T``, dividing input channel ``j`` by ``s_j`` and multiplying weight column
``j`` by it changes nothing in float; with ``s_j = max|x_j|^a / max|W_:,j|^(1-a)`` (Xiao et al.,
ICML 2023) it moves the activation outliers that cost int8 activations their resolution into the
weights, whose per-channel scales absorb them. The division has to happen somewhere:

- into a norm feeding the linears (q/k/v after ``input_layernorm``, gate/up after
  ``post_attention_layernorm``): the norm's weight (and bias) divided by ``s``;
- into the previous linear's output channels through an elementwise product (``down_proj``
  reads ``act(gate) * up``: ``up_proj``'s rows and bias divided by ``s``).

Which inputs have either shape is found from the model's data flow
(:mod:`~qplug_core.weight_only.dataflow`), never assumed from names: an input read by anything
else (a post-norm model's residual) is left unsmoothed. ``o_proj`` is not smoothed: its input
channels come from ``v_proj``'s through attention, and with grouped-query attention several
query heads share each value channel, so one scale per channel cannot be exact for all of them;
per-token activation scales cover it.

``alpha="auto"`` picks the strength per input from the shared grid
(:data:`~qplug_core.kernels.smoothquant_scale.ALPHAS`, including no smoothing) by the int8 output
error of the layers with the activation and weight quantization that will run, scored on sampled
calibration rows the scale (and a static activation range) were not fitted on: half the rows fit,
the other half are scored, and the other way round, as the graph flow does (its module docstring,
``algorithms/smoothquant.py``, records why: in-sample, the strongest smoothing always looks best).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qplug_core.errors import CalibrationError
from qplug_core.kernels.smoothquant_scale import ALPHAS, held_out_halves, smoothquant_scale
from qplug_core.weight_only.batches import call_model, run_batch
from qplug_core.weight_only.dataflow import MulPair, NormGroup, trace_inputs

_SAMPLE_ROWS = 256
#: relative error a norm's output may show after a fold (float32 rounding of w / s)
_FOLD_TOLERANCE = 1e-5


@dataclass
class Smoothed:
    """One smoothed input: where the scales went, the layers reading it and the strength used."""

    into: str
    layers: tuple[str, ...]
    alpha: float | None
    error_before: float | None = None
    error_after: float | None = None


class _Statistics:
    """Per linear input: max |x| per channel over every calibration batch and a few sampled rows."""

    def __init__(self) -> None:
        self.absmax: torch.Tensor | None = None
        self.rows: list[torch.Tensor] = []

    def __call__(self, module: nn.Module, args: tuple) -> None:
        rows = args[0].detach().float().reshape(-1, args[0].shape[-1])
        found = rows.abs().amax(0)
        self.absmax = found if self.absmax is None else torch.maximum(self.absmax, found)
        kept = sum(r.shape[0] for r in self.rows)
        if kept < _SAMPLE_ROWS:
            step = max(1, rows.shape[0] // 32)
            self.rows.append(rows[::step][: _SAMPLE_ROWS - kept].clone())


def norm_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules that may be norms: named ``...Norm`` with a 1-d weight (folds are checked anyway)."""
    return {name: m for name, m in model.named_modules()
            if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 1}


def smooth(model: nn.Module, linears: dict[str, nn.Linear], calibration: Iterable[Any],
           alpha: float | str,
           error: Callable[[torch.Tensor, list[nn.Linear], torch.Tensor | None, torch.Tensor], float],
           unsmoothed: dict[str, str]) -> list[Smoothed]:
    """Fold SmoothQuant scales into ``model`` (in place; the float function is unchanged); returns
    the inputs a scale was folded into.

    ``error(rows, layers, scale, fitting)`` scores a candidate scale for ``alpha="auto"`` on
    ``rows``, the scale and any static activation range fitted on the rows ``fitting``. Layers whose
    input cannot take a folded scale, or where ``"auto"`` found no strength better than none, get
    an entry in ``unsmoothed`` (layer -> reason)."""
    stats = {name: _Statistics() for name in linears}
    handles = [linears[name].register_forward_pre_hook(stats[name]) for name in linears]
    batches: list[Any] = []
    try:
        with torch.no_grad():
            for index, batch in enumerate(calibration):
                run_batch(model, batch, index)
                if not batches:
                    batches.append(batch)
    finally:
        for handle in handles:
            handle.remove()
    if not batches:
        raise CalibrationError("W8A8 smoothing needs calibration batches: pass calibration_data=[batch, ...] "
                               "(token id tensors, or dicts of model inputs), or alpha=None for no smoothing")
    groups, pairs = trace_inputs(model, lambda: call_model(model, batches[0]), linears, norm_modules(model))
    handled: set[str] = set()
    modules = dict(model.named_modules())
    with torch.no_grad():
        entries = [_smooth_group(group, modules, linears, stats, alpha, error) for group in groups]
        entries += [_smooth_pair(pair, linears, stats, alpha, error) for pair in pairs]
    for entry in entries:
        if entry is None:
            continue
        handled.update(entry.layers)
        for name in entry.layers if entry.alpha is None else ():  # nothing folded: not listed as smoothed
            unsmoothed[name] = (f"not smoothed: alpha='auto' found no strength that lowers the int8 output "
                                f"error of {', '.join(entry.layers)} ({entry.error_before:.3g} unsmoothed)")
    for name in linears:
        if name not in handled and stats[name].absmax is not None:
            unsmoothed.setdefault(name, "not smoothed: its input is not a norm's or a product's output read "
                                     "by linears alone, so a scale cannot be folded")
    return [entry for entry in entries if entry is not None and entry.alpha is not None]


def _pick(layers: list[nn.Linear], statistics: _Statistics, absmax: torch.Tensor, alpha: float | str,
          error: Callable) -> tuple[float | None, torch.Tensor | None, float | None, float | None]:
    """(strength, scale, error without, error with) for the layers reading one input; the scale
    itself comes from ``absmax`` (every calibration row), once the strength is chosen."""
    weights = [layer.weight for layer in layers]
    if alpha != "auto":
        return float(alpha), smoothquant_scale(absmax, weights, float(alpha)), None, None
    halves = held_out_halves(torch.cat(statistics.rows))

    def held_out_error(a: float | None) -> float:
        total = 0.0
        for fitting, scored in halves:
            scale = None if a is None else smoothquant_scale(fitting.abs().amax(0), weights, a)
            total += error(scored, layers, scale, fitting)
        return total / len(halves)

    scored = [(held_out_error(a), a) for a in ALPHAS]
    best_error, best = min(scored, key=lambda item: item[0])
    return best, None if best is None else smoothquant_scale(absmax, weights, best), scored[0][0], best_error


def _smooth_group(group: NormGroup, modules: dict[str, nn.Module], linears: dict[str, nn.Linear],
                  stats: dict[str, _Statistics], alpha: float | str, error: Callable) -> Smoothed | None:
    layers = [linears[name] for name in group.linears]
    first = stats[group.linears[0]]
    if first.absmax is None:
        return None
    strength, scale, before, after = _pick(layers, first, first.absmax, alpha, error)
    if scale is not None:
        if not _fold_into_norm(modules[group.norm], scale):
            return None
        for layer in layers:
            layer.weight.mul_(scale)
    return Smoothed(group.norm, group.linears, strength, before, after)


def _smooth_pair(pair: MulPair, linears: dict[str, nn.Linear], stats: dict[str, _Statistics],
                 alpha: float | str, error: Callable) -> Smoothed | None:
    consumer, producer = linears[pair.consumer], linears[pair.producer]
    found = stats[pair.consumer]
    if found.absmax is None or producer.weight.shape[0] != consumer.weight.shape[1]:
        return None
    strength, scale, before, after = _pick([consumer], found, found.absmax, alpha, error)
    if scale is not None:
        producer.weight.div_(scale[:, None])
        if producer.bias is not None:
            producer.bias.div_(scale)
        consumer.weight.mul_(scale)
    return Smoothed(pair.producer, (pair.consumer,), strength, before, after)


def _fold_into_norm(norm: nn.Module, scale: torch.Tensor) -> bool:
    """Divide ``norm``'s output by ``scale`` through its parameters; checked on a probe input.

    ``y = w * n(x) + b`` takes ``w / s``, ``b / s``; Gemma-style ``y = (1 + w) * n(x)`` takes
    ``(1 + w) / s - 1``. A norm that is neither is left as it was (``False``)."""
    weight, bias = norm.weight, getattr(norm, "bias", None)
    if weight.shape != scale.shape:
        return False
    probe = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0), dtype=weight.dtype)
    want = norm(probe) / scale
    saved = weight.detach().clone(), None if bias is None else bias.detach().clone()
    for unit_offset in (False, True):
        if unit_offset:
            weight.copy_((1 + saved[0]) / scale - 1)
        else:
            weight.copy_(saved[0] / scale)
        if bias is not None and saved[1] is not None:
            bias.copy_(saved[1] / scale)
        got = norm(probe)
        if float((got - want).norm() / want.norm().clamp_min(1e-30)) <= _FOLD_TOLERANCE:
            return True
    weight.copy_(saved[0])
    if bias is not None and saved[1] is not None:
        bias.copy_(saved[1])
    return False
