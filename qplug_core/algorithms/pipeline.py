"""``qp.quantize`` with a recipe and/or an accuracy target: fuse, run the recipe, then quantize.

Kept out of ``flows.py`` so the plain flow stays as it was; ``qp.quantize`` (one_call.py) comes here only
when a recipe step or a target is asked for.
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from qplug_core.algorithms.recipes import (
    RecipeContext,
    apply_recipe,
    fused_float_copy,
    looks_like_transformer,
    resolve_recipe,
)
from qplug_core.config import QConfigMapping
from qplug_core.flows.tags import RECIPE

__all__ = ["needs_algorithms", "prepare_algorithms", "quantize_fused", "quantize_with_algorithms"]


def needs_algorithms(model: Any, recipe: Any, target: Any) -> bool:
    """Whether ``qp.quantize`` must take this path (a step to run or a target to meet)."""
    if target is not None:
        return True
    if recipe is None or recipe == "none":
        return False
    if recipe == "auto":
        return isinstance(model, nn.Module) and looks_like_transformer(model)
    return True


def quantize_fused(gm: fx.GraphModule, example_inputs: Any, batches: list[tuple], backend: Any,
                   mapping: QConfigMapping, *, progress: bool | None = None, strict: bool = False,
                   prepare_options: dict[str, Any] | None = None) -> fx.GraphModule:
    """prepare -> calibrate -> convert a fused float graph (``gm`` itself is not modified)."""
    from qplug_core.flows.steps import calibrate, convert_fx, prepare_fx

    observed = prepare_fx(gm, mapping, example_inputs, backend=backend, **(prepare_options or {}))
    calibrate(observed, batches, progress=progress)
    return convert_fx(observed, backend=backend, inplace=True, strict=strict)


def prepare_algorithms(model: nn.Module, example_inputs: Any, calibration_data: Any, backend: Any,
                       qconfig_mapping: QConfigMapping | None, recipe: Any,
                       options: dict[str, Any]) -> tuple:
    """(fused float graph with the recipe applied, inputs, batches, mapping, recipe record).

    ``options`` loses the capture options (they are used here); the rest go to prepare.
    """
    from qplug_core.errors import ConfigValidationError
    from qplug_core.flows.steps import as_input_tuple, iter_batches

    if not isinstance(model, nn.Module):
        raise ConfigValidationError(f"model must be a torch.nn.Module, got {type(model).__name__}",
                                    field="model", value=type(model).__name__)
    mapping = qconfig_mapping if qconfig_mapping is not None else backend.default_qconfig_mapping("static")
    batches = list(iter_batches(calibration_data))
    inputs = as_input_tuple(example_inputs)
    gm = fused_float_copy(model, inputs, backend, options)
    name, steps = resolve_recipe("none" if recipe is None else recipe, model)
    record = apply_recipe(gm, steps, name, RecipeContext(batches, mapping, backend))
    return gm, inputs, batches, mapping, record


def quantize_with_algorithms(model: nn.Module, example_inputs: Any, calibration_data: Any, *,
                             backend: Any, qconfig_mapping: QConfigMapping | None, recipe: Any,
                             target: Any, progress: bool | None, strict: bool,
                             prepare_options: dict[str, Any]) -> fx.GraphModule:
    options = dict(prepare_options)
    if recipe == "auto" and target is None and not strict and looks_like_transformer(model):
        # strict=True asks for every op in int8: a target that may keep layers out conflicts
        from qplug_core.algorithms.target import TRANSFORMER_TARGET
        target = TRANSFORMER_TARGET
    gm, inputs, batches, mapping, record = prepare_algorithms(
        model, example_inputs, calibration_data, backend, qconfig_mapping, recipe, options)
    if target is None:
        qmodel = quantize_fused(gm, inputs, batches, backend, mapping, progress=progress,
                                strict=strict, prepare_options=options)
    else:
        from qplug_core.algorithms.target import meet_target
        qmodel = meet_target(gm, inputs, batches, backend, mapping, target, progress=progress,
                             strict=strict, prepare_options=options)
    qmodel.meta[RECIPE] = record
    return qmodel
