"""The per-channel affines (frozen BatchNorms) folded into convs, as data in a saved file.

``qp.compare`` pairs such a conv with the float value after the affine
(:mod:`qplug_core.flows.channel_affine`); a loaded model without the record paired it with the
float conv's own output again, and its rows read low. The record is conv path -> the affine's
scale and shift (lists of numbers, one per output channel) and the float module that computed it:
nothing in it is resolved or run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from qplug_core.config.codec import child, expect, where
from qplug_core.errors import ConfigError
from qplug_core.flows.channel_affine import FoldedAffine
from qplug_core.serialization.graph_codec import check_path, layer_entries

KEY = "folded_affines"
_FIELDS = ("scale", "shift", "module")


def to_document(affines: Mapping[str, FoldedAffine]) -> dict[str, Any]:
    return {conv: {"scale": a.scale.flatten().tolist(), "shift": a.shift.flatten().tolist(), "module": a.module}
            for conv, a in sorted(affines.items())}


def from_document(doc: Any, path: str, max_entries: int) -> dict[str, FoldedAffine]:
    """The checked record: conv and module paths, as many finite scales as shifts, no more
    entries than the graph has nodes; raises :class:`ConfigError` naming the bad field."""
    affines = {}
    for conv, entry, at in layer_entries(doc, path, max_entries, _FIELDS):
        scale, shift = (_numbers(entry[key], child(at, key)) for key in ("scale", "shift"))
        if len(scale) != len(shift):
            raise ConfigError(f"{where(at)}: {len(scale)} scales for {len(shift)} shifts", field=at, value=len(shift))
        module = expect(entry["module"], str, child(at, "module"), "a module path or \"\"")
        if module:
            check_path(module, child(at, "module"), "affine module")
        affines[conv] = FoldedAffine(torch.tensor(scale), torch.tensor(shift), module)
    return affines


def _numbers(value: Any, path: str) -> list[float]:
    numbers = expect(value, list, path, "a JSON list of numbers")
    for i, number in enumerate(numbers):
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise ConfigError(f"{where(child(path, i))}: {number!r} is not a finite number", field=path, value=number)
    return numbers


def check_convs(affines: Mapping[str, FoldedAffine], root: nn.Module, path: str) -> None:
    """Each recorded conv is a module of the rebuilt model with one affine value per output channel
    (``qp.compare`` multiplies its output by them)."""
    for conv, affine in affines.items():
        try:
            weight = getattr(root.get_submodule(conv), "weight", None)
        except AttributeError:  # no such module
            weight = None
        if not isinstance(weight, torch.Tensor) or weight.dim() < 2 or weight.shape[0] != affine.scale.numel():
            raise ConfigError(f"{where(child(path, conv))}: {affine.scale.numel()} values for "
                              f"{'no conv' if weight is None else f'a conv of weight shape {tuple(weight.shape)}'}",
                              field=child(path, conv), value=conv)

