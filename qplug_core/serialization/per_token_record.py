"""The layers an accuracy target moved to per-token dynamic int8, kept as int8 in a converted model's file.

A target search swaps per-token linears in after convert (:mod:`qplug_core.algorithms.fallbacks`),
into a fresh model or one ``qp.load`` returned (whose file's record is kept and extended), so the
reference form ``qp.save`` writes holds those layers as float ``nn.Linear``: the FFN
linears of all-MiniLM-L6-v2 made its file 0.49x the float weights instead of about a quarter, and
``qp.load`` quantized them again. Each one's int8 weight and per-channel scales are stored instead,
as the per-token codec writes them (:mod:`qplug_core.serialization.per_token_codec`), under
``per_token/<layer>/``; the record (layer -> the key of the reference weight they stand for) is
plain data. ``load`` rebuilds that weight from them (``weight_int8 * scale``, what the layer
computes with) and the per-token layer from them directly, so the loaded model computes what the
saved one did. Files written before hold the float weights and load as they did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from qplug_core.config.codec import child, encode_dtype, expect, read_fields, where
from qplug_core.errors import ConfigError
from qplug_core.kernels.per_token import PER_TOKEN_LAYERS, PerTokenDynamicLinear
from qplug_core.serialization import per_token_codec

KEY = "per_token_int8"
_PREFIX = "per_token/"
_ENTRY = ("weight",)


def _key(layer: str, field: str) -> str:
    return f"{_PREFIX}{layer}/{field}"


def record(model: dict[str, Any], tensors: dict[str, torch.Tensor], qmodel: nn.Module, layers: Sequence[str]
           ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``model`` and ``tensors`` (a reference form as encoded) with the per-token ``layers`` running in
    ``qmodel`` stored as their int8 weights and scales instead of float weights. A layer that no
    longer runs per-token, or whose float32 weight another module shares, keeps its float weight;
    one recorded already (a loaded file's) keeps its record."""
    uses = _weight_keys(model)
    table, tensors = dict(model["tensors"]), dict(tensors)
    entries = dict(model.get(KEY, {}))
    for layer in layers:
        if layer in entries:
            continue
        try:
            module, path = qmodel.get_submodule(layer), layer
        except AttributeError:  # the model was changed after quantizing: the reference form is saved
            continue
        if isinstance(module, nn.Sequential) and len(module):  # a fused LinearReLU: its linear
            module, path = module[0], f"{layer}.0"
        key = uses.get(path)
        if not isinstance(module, PerTokenDynamicLinear) or key is None or \
                list(uses.values()).count(key) != 1 or table[key]["dtype"] != encode_dtype(torch.float32):
            continue
        values = per_token_codec.encode(module)
        del table[key], tensors[key]
        for field in per_token_codec.WEIGHT_FIELDS:
            value = cast(torch.Tensor, values[field])  # a per-token layer always has both
            table[_key(layer, field)] = {"dtype": encode_dtype(value.dtype), "shape": list(value.shape)}
            tensors[_key(layer, field)] = value.detach()
        entries[layer] = {"weight": key}
    return ({**model, "tensors": table, KEY: entries}, tensors) if len(entries) > len(model.get(KEY, {})) \
        else (model, tensors)


def _weight_keys(model: dict[str, Any]) -> dict[str, str]:
    """Module path -> the key of its ``weight`` parameter; every other tensor use under ``""``."""
    uses = {}
    for entry in model["modules"]:
        for name, key in [*entry.get("params", []), *entry.get("buffers", [])]:
            uses[entry["path"] if name == "weight" else f"{entry['path']}.{name}"] = key
    uses.update({target: spec["key"] for target, spec in model["attributes"].items()})
    return uses


def check(doc: Any, model: dict[str, Any], tensors: dict[str, torch.Tensor], path: str) -> None:
    """The record of a file whose tensors match its table: each layer one of the file's per-token
    layers, standing for a weight the file does not hold otherwise, with int8 values and positive
    scales; raises :class:`ConfigError` naming the bad field."""
    per_token = set(model.get(PER_TOKEN_LAYERS, []))
    replaced: set[str] = set()
    for layer, entry in expect(doc, dict, path, "a JSON object").items():
        at = child(path, layer)
        if layer not in per_token:
            raise ConfigError(f"{where(at)}: {layer!r} is not one of the file's per-token layers",
                              field=at, value=layer)
        read_fields(entry, at, _ENTRY, required=_ENTRY)
        key = expect(entry["weight"], str, child(at, "weight"), "a tensor name")
        if key in model["tensors"] or key in replaced:
            raise ConfigError(f"{where(child(at, 'weight'))}: tensor {key!r} is in the file already",
                              field=child(at, "weight"), value=key)
        replaced.add(key)
        values = {field: tensors.get(_key(layer, field)) for field in per_token_codec.WEIGHT_FIELDS}
        weight = values["weight_int8"]
        shape = (weight.shape[0], weight.shape[1]) if weight is not None and weight.dim() == 2 else (0, 0)
        problem = per_token_codec.weight_problem(values, shape, layer)
        if problem is not None:
            raise ConfigError(f"{where(at)}: {problem}", field=at, value=layer)


def expand(model: dict[str, Any], tensors: dict[str, torch.Tensor]
           ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The reference form to decode: each recorded layer's float weight rebuilt from its int8
    values in place of them (a copy; the artifact keeps the file's form, so saving it again gives
    the same file)."""
    entries = model.get(KEY)
    if not entries:
        return model, tensors
    table, tensors = dict(model["tensors"]), dict(tensors)
    for layer, entry in entries.items():
        weight_int8, scale = (tensors.pop(_key(layer, field)) for field in per_token_codec.WEIGHT_FIELDS)
        for field in per_token_codec.WEIGHT_FIELDS:
            del table[_key(layer, field)]
        weight = weight_int8.float() * scale[:, None]
        table[entry["weight"]] = {"dtype": encode_dtype(weight.dtype), "shape": list(weight.shape)}
        tensors[entry["weight"]] = weight
    return {**model, "tensors": table}, tensors


def saved_weights(model: dict[str, Any], tensors: dict[str, torch.Tensor]
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Layer -> (int8 weight, per-channel scales) of the recorded layers."""
    return {layer: (tensors[_key(layer, "weight_int8")], tensors[_key(layer, "weight_scale")])
            for layer in model.get(KEY, {})}
