"""The float ops after a layer that its int8 output already computes, from the model's own records.

A layer fused with the ReLU after it (``LinearReLU``), or a conv a frozen BatchNorm was folded into,
outputs the value *after* those ops; on an export-captured model the float model's module of that
name is the bare Linear or conv, so the pair read 1-5 dB, the ReLU's negative half or the affine
counted as error. qp.compare applies these followers to the float module's output instead: what the
fusion records (``FUSIONS``), the folds (``FOLDED_AFFINES``) and the absorbed clamps say, in order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.flows.channel_affine import FoldedAffine
from qplug_core.flows.clamps import AbsorbedClamp
from qplug_core.flows.fuse import FusionRecord
from qplug_core.flows.tags import FOLDED_AFFINES, FUSIONS
from qplug_core.patterns import format_pattern

__all__ = ["Followers", "layer_followers"]

#: how a fusion record writes a ReLU anchor (``F.relu <- Linear``)
_RELU_HEADS = {format_pattern((relu, nn.Linear)).split(" <- ")[0]
               for relu in (nn.ReLU, F.relu, torch.relu, "relu", torch.relu_, "relu_")}


@dataclass(frozen=True)
class Followers:
    """The ops after a layer, in order, that its int8 output holds."""

    steps: tuple[AbsorbedClamp | FoldedAffine, ...]

    def apply(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (the float layer's output) as the float model has it after the steps."""
        for step in self.steps:
            value = step.apply(value)
        return value

    @property
    def ops(self) -> str:
        """``+affine+ReLU``: appended to the float type in the report."""
        return "".join(f"+{step.op}" for step in self.steps)

    @property
    def modules(self) -> set[str]:
        """The float modules the steps ran as (computed by the layer, so not absent from it)."""
        return {step.module for step in self.steps if step.module}


def _meta(model: nn.Module) -> dict[str, Any]:
    meta = getattr(model, "meta", None)
    return meta if isinstance(meta, dict) else {}


def _fused_relu(record: FusionRecord, float_modules: Mapping[str, nn.Module]) -> AbsorbedClamp | None:
    """The ReLU a two-op fusion (``F.relu <- Linear``) put into ``record.module_name``, when the float
    model's module of that name is the bare first op (a fused float model computes it already)."""
    float_module = float_modules.get(record.module_name)
    if (len(record.nodes) != 2 or record.pattern.split(" <- ")[0] not in _RELU_HEADS
            or float_module is None or type(float_module).__name__ == record.fused_type):
        return None
    module = record.anchor_module if isinstance(float_modules.get(record.anchor_module), nn.ReLU) else None
    return AbsorbedClamp(0.0, math.inf, "ReLU" if module else "relu", module)


def layer_followers(float_model: nn.Module, quantized_model: nn.Module,
                    clamps: Mapping[str, AbsorbedClamp]) -> dict[str, Followers]:
    """Layer path -> its :class:`Followers`: a folded affine, then a fused ReLU, then the absorbed
    clamp (``clamps``) of the layers that have any."""
    float_modules = dict(float_model.named_modules())
    meta = _meta(quantized_model)
    steps: dict[str, list[AbsorbedClamp | FoldedAffine]] = {}
    folded_in_float = _meta(float_model).get(FOLDED_AFFINES, {})  # qp.fuse_fx of it folds them too
    for name, affine in meta.get(FOLDED_AFFINES, {}).items():
        if name not in folded_in_float:
            steps.setdefault(name, []).append(affine)
    for record in meta.get(FUSIONS, []):
        relu = _fused_relu(record, float_modules)
        if relu is not None:
            steps.setdefault(record.module_name, []).append(relu)
    for name, clamp in clamps.items():
        steps.setdefault(name, []).append(clamp)
    return {name: Followers(tuple(found)) for name, found in steps.items()}
