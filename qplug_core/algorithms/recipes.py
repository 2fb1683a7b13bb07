"""Recipes: which algorithm passes run on the fused float graph before observers go in.

``qp.quantize(model, example, calibration, recipe="dfq")`` fuses the model, runs the recipe's steps
in order on the fused float graph (each changes weights so the float function is unchanged, or
moves biases using the calibration data), then prepares, calibrates and converts as usual.
``recipe="auto"`` picks by model: a transformer (``nn.Linear`` and ``nn.LayerNorm`` beside
attention or in every block, convs only as a patchify stem or a small share: :func:`transformer_verdict`) gets SmoothQuant and, unless a target is given, ``TRANSFORMER_TARGET`` (``Target(cosine=0.998,
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
    """Whether ``recipe="auto"`` treats ``model`` as a transformer (:func:`transformer_verdict`)."""
    return transformer_verdict(model)[0]


def transformer_verdict(model: Any) -> tuple[bool, str]:
    """(transformer?, why in words): linear layers and LayerNorms of blocks with attention, the case
    SmoothQuant is for. Attention is a softmax, ``nn.MultiheadAttention`` or a module named
    ``*Attention`` (Hugging Face's hide the softmax in their forward); two LayerNorms (an encoder
    has two a block) count as blocks too. One LayerNorm in an MLP (a tabular model) is not a
    transformer: it got SmoothQuant and the transformer target, whose per-sample cosines of a
    one-logit output took every linear out of static int8. Convolutions disqualify unless there is
    attention and they are a patchify stem (stride = kernel: a linear on patches, ViT, Swin, CLIP) or
    hold under a quarter of the weighted layers' parameters (Whisper's, wav2vec2's front end): a
    CNN with a linear head or ConvNeXt's LayerNorm blocks (no attention) stays a CNN. An
    ``ExportedProgram`` (or its ``.module()``) is read by its ATen ops, its modules being
    flattened: the same BERT quantized from its program got no SmoothQuant and another int8 model."""
    if isinstance(model, torch.export.ExportedProgram):
        model = model.graph_module
    if not isinstance(model, nn.Module):
        return False, "not an nn.Module"
    modules = list(model.modules())
    types = {type(m) for m in modules}
    calls = ([n for n in model.graph.nodes if n.op in ("call_function", "call_method")]
             if isinstance(model, fx.GraphModule) else [])
    targets = [n.target for n in calls]
    layer_norms = sum(type(m) is nn.LayerNorm for m in modules) + sum(t in _ATEN_LAYER_NORMS for t in targets)
    attention = (bool(types & {nn.MultiheadAttention, nn.Softmax}) or any(t in _SOFTMAXES for t in targets)
                 or any(t.__name__.endswith("Attention") for t in types))
    layers = [*_module_layers(modules), *_aten_layers(calls)]
    if not any(kind == "linear" for kind, _, _ in layers):
        return False, "no nn.Linear"
    if not (layer_norms >= 2 or (layer_norms == 1 and attention)):
        return False, f"{layer_norms} LayerNorm(s){' beside attention' if attention else ', no attention'}"
    convs = [(patchify, size) for kind, patchify, size in layers if kind == "conv"]
    if not convs:
        return True, f"nn.Linear, {layer_norms} LayerNorm(s){', attention' if attention else ''}, no convs"
    total = sum(size for _, _, size in layers)
    share = sum(size for patchify, size in convs if not patchify) / total
    if not attention:
        return False, f"{len(convs)} conv(s) and no attention"
    if share >= _CONV_SHARE:
        return False, f"{len(convs)} conv(s) holding {share:.0%} of the weighted layers' parameters"
    others = sum(not patchify for patchify, _ in convs)
    stem = (f"{len(convs) - others} patchify conv(s)" if not others else
            f"{others} conv(s) holding {share:.0%} of the weighted layers' parameters")
    return True, f"nn.Linear, {layer_norms} LayerNorm(s), attention, {stem}"


#: convs that are no patchify stem disqualify from this share of the weighted layers' parameters
_CONV_SHARE = 0.25


def _module_layers(modules: list[nn.Module]) -> list[tuple[str, bool, int]]:
    """(kind, patchify, parameter count) of each ``nn.Linear`` and convolution module."""
    layers = []
    for m in modules:
        if type(m) is nn.Linear:
            layers.append(("linear", False, m.weight.numel()))
        elif isinstance(m, nn.modules.conv._ConvNd):
            layers.append(("conv", _patchify(m.kernel_size, m.stride), m.weight.numel()))
    return layers


def _aten_layers(calls: list[fx.Node]) -> list[tuple[str, bool, int]]:
    """:func:`_module_layers` of an exported graph's ATen linears and convolutions."""
    layers = []
    for node in calls:
        if node.target not in _ATEN_CONVS and node.target != aten.linear.default:
            continue
        weight = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
        size = weight.numel() if isinstance(weight, torch.Tensor) else 0
        if node.target == aten.linear.default:
            layers.append(("linear", False, size))
            continue
        stride = node.args[3] if len(node.args) > 3 else node.kwargs.get("stride", 1)
        kernel = tuple(weight.shape[2:]) if isinstance(weight, torch.Tensor) else ()
        layers.append(("conv", _patchify(kernel, stride), size))
    return layers


def _patchify(kernel: Any, stride: Any) -> bool:
    """A kernel larger than one that strides by its own size: a linear on non-overlapping patches."""
    kernel = tuple(kernel)
    stride = tuple(stride) if isinstance(stride, (tuple, list)) else (stride,) * len(kernel)
    return bool(kernel) and kernel == stride and any(k > 1 for k in kernel)


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
