"""Recipes: which algorithm passes run on the fused float graph before observers go in.

``qp.quantize(model, example, calibration, recipe="dfq")`` fuses the model, runs the recipe's steps
in order on the fused float graph (each changes weights so the float function is unchanged, or
moves biases using the calibration data), then prepares, calibrates and converts as usual.
``recipe="auto"`` picks by model: a transformer (``nn.Linear`` and ``nn.LayerNorm`` beside
attention or in every block, convs only as a stem or a small share: :func:`~qplug_core.algorithms.architecture.transformer_verdict`) gets SmoothQuant and, unless a target is given, ``TRANSFORMER_TARGET`` (``Target(cosine=0.998,
min_cosine=0.995, neighbours=0.95)``) on the calibration data. Anything else gets no pass here:
``qp.quantize`` corrects its biases while it calibrates (``one_call.corrects_bias_by_default``),
and cross-layer equalization only pays off with per-tensor weights (see docs/guide/accuracy.md for
the figures).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from qplug_core.algorithms.architecture import looks_like_transformer
from qplug_core.algorithms.bias_correction import correct_bias
from qplug_core.algorithms.equalization import equalize_cross_layer
from qplug_core.algorithms.smoothquant import smooth_quant
from qplug_core.config import QConfigMapping
from qplug_core.errors import ConfigValidationError, did_you_mean
from qplug_core.nn.computed_weights import copy_model

__all__ = ["RECIPES", "RecipeRecord", "apply_recipe", "resolve_recipe"]


@dataclass
class RecipeContext:
    """What a step may use: calibration batches, the mapping and backend quantization will use."""

    calibration: list[tuple]
    qconfig_mapping: QConfigMapping
    backend: Any


def _equalize(gm: fx.GraphModule, ctx: RecipeContext) -> Any:
    return equalize_cross_layer(gm)


def _bias_correction(gm: fx.GraphModule, ctx: RecipeContext) -> Any:
    return correct_bias(gm, ctx.calibration, qconfig_mapping=ctx.qconfig_mapping)


def _smoothquant(gm: fx.GraphModule, ctx: RecipeContext) -> Any:
    return smooth_quant(gm, ctx.calibration, qconfig_mapping=ctx.qconfig_mapping, backend=ctx.backend)


STEPS: dict[str, Callable[[fx.GraphModule, RecipeContext], Any]] = {
    "equalize": _equalize,
    "bias_correction": _bias_correction,
    "smoothquant": _smoothquant,
}

#: named recipes -> their steps, in order
RECIPES: dict[str, tuple[str, ...]] = {
    "none": (),
    "dfq": ("equalize", "bias_correction"),  # data-free quantization (Nagel et al. 2019)
    "equalize": ("equalize",),
    "bias_correction": ("bias_correction",),
    "smoothquant": ("smoothquant",),
}


@dataclass
class RecipeRecord:
    """What a recipe did: its name, steps, and each step's result list (pairs, layers...)."""

    name: str
    steps: tuple[str, ...]
    results: dict[str, Any] = field(default_factory=dict)


def resolve_recipe(recipe: str | tuple | list, model: nn.Module) -> tuple[str, tuple[str, ...]]:
    """(name, steps) for a recipe name, "auto", or a sequence of step names."""
    if isinstance(recipe, str):
        if recipe == "auto":
            return ("auto: smoothquant", RECIPES["smoothquant"]) if looks_like_transformer(model) \
                else ("auto: none", ())
        if recipe not in RECIPES:
            raise ConfigValidationError(
                f"unknown recipe {recipe!r}{did_you_mean(recipe, [*RECIPES, 'auto'])}; use one of "
                f"{', '.join([*RECIPES, 'auto'])} or a list of steps from {', '.join(STEPS)}",
                field="recipe", value=recipe)
        return recipe, RECIPES[recipe]
    if isinstance(recipe, (tuple, list)) and all(isinstance(s, str) for s in recipe):
        for step in recipe:
            if step not in STEPS:
                raise ConfigValidationError(
                    f"unknown recipe step {step!r}{did_you_mean(step, STEPS)}; steps: "
                    f"{', '.join(STEPS)}", field="recipe", value=step)
        return "+".join(recipe), tuple(recipe)
    raise ConfigValidationError(f"recipe must be a name or a list of step names, got "
                                f"{type(recipe).__name__}", field="recipe", value=recipe)


def apply_recipe(gm: fx.GraphModule, steps: tuple[str, ...], name: str,
                 ctx: RecipeContext) -> RecipeRecord:
    """Run ``steps`` on the fused float graph ``gm`` in place."""
    record = RecipeRecord(name, steps)
    for step in steps:
        record.results[step] = STEPS[step](gm, ctx)
    return record


def fused_float_copy(model: nn.Module, example_inputs: Any, backend: Any,
                     options: dict[str, Any]) -> fx.GraphModule:
    """The eval-mode fused float graph of a copy of ``model`` (the user's model is untouched; an
    ``ExportedProgram`` is captured through a fresh ``.module()``)."""
    from qplug_core.flows.steps import fuse_fx

    source = model if isinstance(model, torch.export.ExportedProgram) else copy_model(model).eval()
    capture = {k: options.pop(k) for k in ("capture", "non_traceable_module_names",
                                           "non_traceable_module_classes") if k in options}
    return fuse_fx(source, example_inputs, backend=backend, inplace=True, **capture)
