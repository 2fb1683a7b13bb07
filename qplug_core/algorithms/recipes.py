"""Recipes: which algorithm passes run on the fused float graph before observers go in.

``qp.quantize(model, example, calibration, recipe="dfq")`` fuses the model, runs the recipe's steps
in order on the fused float graph (each changes weights so the float function is unchanged, or
moves biases using the calibration data), then prepares, calibrates and converts as usual.
``recipe="auto"`` picks by model: a transformer (``nn.Linear``, no convs, and ``nn.LayerNorm`` beside
attention or in every block: :func:`looks_like_transformer`) gets SmoothQuant and, unless a target is given, ``TRANSFORMER_TARGET`` (``Target(cosine=0.998,
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


def looks_like_transformer(model: Any) -> bool:
    """Linear layers, no convolutions, and LayerNorms of blocks with attention: the case SmoothQuant
    is for. Attention is a softmax or ``nn.MultiheadAttention``; a module hides the softmax in its
    forward, so two LayerNorms (an encoder has two a block) count as blocks too. One LayerNorm in
    an MLP (a tabular model) is not a transformer: it got SmoothQuant and the transformer target,
    whose per-sample cosines of a one-logit output took every linear out of static int8. An
    ``ExportedProgram`` (or its ``.module()``) is read by its ATen ops, its modules being
    flattened: the same BERT quantized from its program got no SmoothQuant and another int8 model."""
    if isinstance(model, torch.export.ExportedProgram):
        model = model.graph_module
    if not isinstance(model, nn.Module):
        return False
    modules = list(model.modules())
    types = {type(m) for m in modules}
    calls = ([n.target for n in model.graph.nodes if n.op in ("call_function", "call_method")]
             if isinstance(model, fx.GraphModule) else [])
    layer_norms = sum(type(m) is nn.LayerNorm for m in modules) + sum(t in _ATEN_LAYER_NORMS for t in calls)
    attention = bool(types & {nn.MultiheadAttention, nn.Softmax}) or any(t in _SOFTMAXES for t in calls)
    linear = nn.Linear in types or aten.linear.default in calls
    convs = any(issubclass(t, nn.modules.conv._ConvNd) for t in types) or any(t in _ATEN_CONVS for t in calls)
    return linear and not convs and (layer_norms >= 2 or (layer_norms == 1 and attention))


aten = torch.ops.aten
_ATEN_LAYER_NORMS = {aten.layer_norm.default, aten.native_layer_norm.default}
_ATEN_CONVS = {aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
               aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input}
#: a softmax or fused attention in a graph (a symbolic trace's functions and methods, or ATen ops)
_SOFTMAXES = {torch.softmax, torch.nn.functional.softmax, "softmax", aten._softmax.default, aten.softmax.int,
              torch.nn.functional.scaled_dot_product_attention, aten.scaled_dot_product_attention.default}


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
