"""``qp.compare``: per-layer error by module name (or float call), plus one row per compiled partition.

Name-by-name comparison (:func:`qplug_core.analysis.layers.compare_layers`) finds the layers a kernel backend
keeps under the float model's names; a delegate backend's partitions have no such names, so
they are measured as units (:mod:`qplug_core.analysis.partitions`) and added to the same report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from qplug_core.analysis.fused_float import fused_like, unfused_layers
from qplug_core.analysis.layers import ComparisonReport, batches_of
from qplug_core.analysis.layers import compare_layers as compare_by_name
from qplug_core.analysis.partitions import partition_comparisons
from qplug_core.flows.checks import check_model
from qplug_core.flows.float_reference import float_like_int8
from qplug_core.flows.normalize import functional_weights
from qplug_core.flows.pipeline import eval_mode
from qplug_core.flows.tags import W8A8


def compare(float_model: nn.Module, quantized_model: nn.Module, inputs: Any, *,
            layers: Iterable[str] | str | None = None) -> ComparisonReport:
    """Run both models on ``inputs`` and report per-layer and output error.

    ``inputs`` is one tuple of positional args, a bare tensor, or an iterable of such batches (a
    list, a DataLoader). ``layers`` restricts the hooked modules (default: every module with the
    same qualified name in both models, and every int8 layer made from a functional call such as
    ``F.conv2d(x, self.w)``, paired with that call in the float model). A delegated model also gets one row per compiled
    partition (``delegate_0``, ...): its output on the inputs it receives, against its float form
    (``sqnr_db``) and against its reference form (``reference_sqnr_db``); the layers inside a
    partition do not run as themselves and move to ``skipped``, as do the partitions without a row
    (kept in reference form at convert, or not measurable), with the reason. Both models run in eval
    mode without gradients; neither is modified. A float model that runs separately what the
    quantized one fused (conv, bn, relu) is compared as ``qp.fuse_fx`` of it, with a warning.
    """
    check_model(float_model, "float_model")
    check_model(quantized_model, "quantized_model")
    batches = list(batches_of(inputs, float_model))
    unfused = unfused_layers(float_model, quantized_model) if batches else []
    float_model, not_paired = fused_like(float_model, quantized_model, batches[0], unfused) \
        if unfused else (float_model, {})
    report = _without_rescaled(compare_by_name(float_model, quantized_model, batches, layers=layers),
                               quantized_model)
    if not_paired:
        report = dataclasses.replace(
            report, layers=[layer for layer in report.layers if layer.name not in not_paired],
            skipped={**report.skipped, **not_paired})
    if layers is not None:
        return report
    with torch.no_grad(), float_like_int8(float_model), eval_mode(float_model), eval_mode(quantized_model):
        partitions = partition_comparisons(float_model, quantized_model, batches)
    # the float layers a compiled partition took: a row of theirs would describe the reference form,
    # and (the partition owns them, not the model) they are no float modules absent from int8 either;
    # nor have the layers made from functional calls in it a module of their own to hook
    inside = {name: partitions.inside[name] for name in (*(layer.name for layer in report.layers),
                                                        *report.float_only, *functional_weights(quantized_model))
              if name in partitions.inside}
    return dataclasses.replace(
        report, layers=[*(layer for layer in report.layers if layer.name not in inside),
                        *partitions.rows],
        float_only=[name for name in report.float_only if name not in inside],
        float_only_kinds={name: kind for name, kind in report.float_only_kinds.items() if name not in inside},
        skipped={**report.skipped, **{name: f"inside compiled partition {partition}: measured "
                                             "as part of it" for name, partition in inside.items()},
                 **partitions.skipped})


def _without_rescaled(report: ComparisonReport, quantized_model: nn.Module) -> ComparisonReport:
    """A W8A8 model's modules SmoothQuant folded a scale into (a norm, an up projection) answer
    unlike float by design, the next layer undoing it: shown as layers, they read as 1-6 dB."""
    info = getattr(quantized_model, W8A8, None)
    rescaled = {entry.into for entry in getattr(info, "smoothed", ())}
    if not rescaled:
        return report
    return dataclasses.replace(
        report, layers=[layer for layer in report.layers if layer.name not in rescaled],
        skipped={**report.skipped, **{layer.name: "SmoothQuant folded a scale into it: its output differs "
                                                  "from float by design, the next layer undoes it"
                                      for layer in report.layers if layer.name in rescaled}})
