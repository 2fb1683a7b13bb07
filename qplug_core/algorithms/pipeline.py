"""The building blocks of ``qp.quantize`` with a recipe or a target: fuse and run the recipe
(:func:`prepare_algorithms`), then quantize the fused model (:func:`quantize_fused`).

The plain flow stays as it was; ``qp.quantize`` (one_call.py) composes these only when a recipe
step or a target is asked for, and the target search and sensitivity reuse them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from qplug_core.algorithms.recipes import (
    RecipeContext,
    apply_recipe,
    fused_float_copy,
    resolve_recipe,
)
from qplug_core.config import QConfigMapping
from qplug_core.errors import ConfigValidationError
from qplug_core.flows.weight_bits import backend_defaults
from qplug_core.ir.copying import deepcopy_sharing

__all__ = ["prepare_algorithms", "prepare_sharing_weights", "quantize_fused"]


def prepare_sharing_weights(gm: fx.GraphModule, mapping: QConfigMapping, example_inputs: Any, backend: Any,
                            prepare_options: dict[str, Any] | None = None) -> fx.GraphModule:
    """``prepare_fx`` of a copy of the fused float ``gm`` holding ``gm``'s own weight tensors.

    Nothing after prepare here writes a weight (calibration reads them, convert rounds copies, the
    target search runs them), and a full copy for each observed model was the float model's bytes
    again at the peak of every try. Biases are copied: convert corrects them in place."""
    from qplug_core.flows.steps import prepare_fx

    weights = [m._parameters["weight"] for m in gm.modules() if m._parameters.get("weight") is not None]
    return prepare_fx(deepcopy_sharing(gm, weights), mapping, example_inputs, backend=backend,
                      **{**(prepare_options or {}), "inplace": True})


def quantize_fused(gm: fx.GraphModule, example_inputs: Any, batches: list[tuple], backend: Any,
                   mapping: QConfigMapping, *, progress: bool | None = None, strict: bool = False,
                   allow_float: bool = False, prepare_options: dict[str, Any] | None = None) -> fx.GraphModule:
    """prepare -> calibrate -> convert a fused float graph (``gm`` itself is not modified)."""
    from qplug_core.flows.steps import calibrate, convert_fx

    observed = prepare_sharing_weights(gm, mapping, example_inputs, backend, prepare_options)
    calibrate(observed, batches, progress=progress)
    return convert_fx(observed, backend=backend, inplace=True, strict=strict, allow_float=allow_float,
                      progress=progress)


def prepare_algorithms(model: nn.Module, example_inputs: Any, calibration_data: Any, backend: Any,
                       qconfig_mapping: QConfigMapping | None, recipe: Any,
                       options: dict[str, Any]) -> tuple:
    """(fused float graph with the recipe applied, inputs, batches, mapping, recipe record).

    ``options`` loses the capture options (they are used here); the rest go to prepare.
    """
    from qplug_core.flows.steps import as_input_tuple, iter_batches

    if not isinstance(model, (nn.Module, torch.export.ExportedProgram)):
        raise ConfigValidationError(f"model must be a torch.nn.Module or an ExportedProgram, got "
                                    f"{type(model).__name__}", field="model", value=type(model).__name__)

    # the defaults are resolved here (the recipe needs them): marked so they stay the defaults
    mapping = qconfig_mapping if qconfig_mapping is not None else backend_defaults(backend)
    batches = list(iter_batches(calibration_data, model))
    inputs = as_input_tuple(example_inputs, model)
    gm = fused_float_copy(model, inputs, backend, options)
    name, steps = resolve_recipe("none" if recipe is None else recipe, model)
    record = apply_recipe(gm, steps, name, RecipeContext(batches, mapping, backend))
    return gm, inputs, batches, mapping, record
