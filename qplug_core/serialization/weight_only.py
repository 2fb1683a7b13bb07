"""Weight-only models (``qp.quantize_weights``) in and out of one ``.safetensors`` file.

The file holds plain tensors (each quantized layer's ``qweight`` / ``scales`` / ``zero_points``,
``bias`` and ``input_scale``; the rest of the model's float state under its ``state_dict`` keys)
and a JSON document listing the quantized layers by module name, kind and shape, and the scheme.
No code and no class name is stored: the model is rebuilt by the user (their own class, from its
config) and passed to ``qp.load(path, model=...)``, which checks every listed name against that
model's own modules (a table of its ``named_modules()``, never an attribute walk), swaps the
quantized layers in, loads the float state and picks kernels for this CPU again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qplug_core.errors import SerializationError
from qplug_core.kernels.weight_only_scheme import QuantizedWeight, WeightOnlyScheme
from qplug_core.serialization.files import write_artifact_file
from qplug_core.weight_only.api import INFO_ATTRIBUTE, WeightOnlyInfo, conv1d_class, linear_weight
from qplug_core.weight_only.modules import WeightOnlyEmbedding, WeightOnlyLinear
from qplug_core.weight_only.selection import available_kernels, choose

FORMAT = "qplug-weight-only"
SCHEMA_VERSION = 1
_QUANTIZED = "quantized/"
_FLOAT = "float/"
_FIELDS = ("qweight", "scales", "zero_points", "bias", "input_scale")


def is_weight_only(model: Any) -> bool:
    return isinstance(getattr(model, INFO_ATTRIBUTE, None), WeightOnlyInfo)


def is_weight_only_document(document: Any) -> bool:
    return isinstance(document, dict) and document.get("format") == FORMAT


def save_weight_only(model: nn.Module, target: Path) -> Path:
    info: WeightOnlyInfo = getattr(model, INFO_ATTRIBUTE)
    modules = dict(model.named_modules())
    layers, tensors = [], {}
    for name, kind in info.layers.items():
        module = modules.get(name)
        if not isinstance(module, (WeightOnlyLinear, WeightOnlyEmbedding)):
            raise SerializationError(f"cannot save to {target}: layer {name!r} is no longer a weight-only "
                                     "module (the model was changed after qp.quantize_weights)", path=str(target))
        layer = {"name": name, "kind": kind, "shape": list(module.quantized_weight().shape),
                 "scheme": module.scheme.to_dict()}
        if isinstance(module, WeightOnlyLinear):
            layer["transposed"] = module.from_transposed
        else:
            layer["padding_idx"] = module.padding_idx
        for field in _FIELDS:
            value = getattr(module, field, None)
            if value is not None:
                tensors[f"{_QUANTIZED}{name}/{field}"] = value.detach()
        layers.append(layer)
    prefixes = tuple(f"{name}." for name in info.layers)
    for key, value in model.state_dict().items():
        if not key.startswith(prefixes):
            tensors[_FLOAT + key] = value
    document = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "algorithm": info.algorithm,
                "scheme": info.scheme.to_dict(), "layers": layers, "skipped": info.skipped}
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)
    write_artifact_file(target, text, tensors)
    return target


def load_weight_only(document: dict, tensors: dict[str, torch.Tensor], source: Path,
                     model: nn.Module | None, backend: str | None) -> nn.Module:
    """Fill ``model`` (built by the user from the same class and config) and return it."""
    if not isinstance(model, nn.Module):
        raise SerializationError(
            f"{source} holds a weight-only model: pass the model to fill, built from its class and config "
            "like the original, e.g. qp.load(path, model=AutoModelForCausalLM.from_config(config))",
            path=str(source))
    if document.get("schema_version") != SCHEMA_VERSION:
        raise SerializationError(f"{source}: weight-only schema_version {document.get('schema_version')!r} "
                                 f"is not supported (this qplug reads {SCHEMA_VERSION}); upgrade qplug",
                                 path=str(source))
    try:
        info = WeightOnlyInfo(WeightOnlyScheme.from_dict(document["scheme"]), str(document["algorithm"]),
                              skipped=dict(document.get("skipped", {})))
        layers = list(document["layers"])
    except Exception as exc:  # a tampered document: wrong types, missing keys
        raise SerializationError(f"{source} is not a valid qplug weight-only file: {type(exc).__name__}: "
                                 f"{exc}", path=str(source)) from exc
    kernels = available_kernels(backend)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for layer in layers:
            name, swapped = _rebuild_layer(layer, modules, tensors, source, kernels, info)
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, swapped)
            info.layers[name] = layer["kind"]
        _load_float_state(model, info, tensors, source)
    setattr(model, INFO_ATTRIBUTE, info)
    return model


def _rebuild_layer(layer: Any, modules: dict[str, nn.Module], tensors: dict[str, torch.Tensor],
                   source: Path, kernels: list, info: WeightOnlyInfo) -> tuple[str, nn.Module]:
    def bad(message: str) -> SerializationError:
        return SerializationError(f"{source}: {message}", path=str(source))

    if not isinstance(layer, dict) or not isinstance(layer.get("name"), str):
        raise bad(f"a layer entry is malformed: {layer!r}")
    name, kind = layer["name"], layer.get("kind")
    target = modules.get(name)
    if target is None or not name:
        raise bad(f"layer {name!r} is not a module of the model given to qp.load (is it built from the same "
                  "class and config?)")
    try:
        scheme = WeightOnlyScheme.from_dict(layer["scheme"])
        n, k = (int(v) for v in layer["shape"])
    except Exception as exc:
        raise bad(f"layer {name!r} is malformed: {type(exc).__name__}: {exc}") from exc
    expected = _expected_shape(target, kind)
    if expected is None:
        raise bad(f"layer {name!r} was a {kind} but the model given has a {type(target).__name__} there")
    if expected != (n, k):
        raise bad(f"layer {name!r} has shape {(n, k)} in the file but {expected} in the model given")
    values = {f: tensors.get(f"{_QUANTIZED}{name}/{f}") for f in _FIELDS}
    groups = scheme.groups(k)
    data_width = k if scheme.bits == 8 else (k + 1) // 2
    _check(values["qweight"], (n, data_width), torch.uint8, name, "qweight", source)
    _check(values["scales"], (n, groups), torch.float32, name, "scales", source)
    if not scheme.symmetric:
        _check(values["zero_points"], (n, groups), torch.uint8, name, "zero_points", source)
    weight = QuantizedWeight(scheme, (n, k), values["qweight"], values["scales"], values["zero_points"])
    if kind == "embedding":
        padding = layer.get("padding_idx")
        return name, WeightOnlyEmbedding(weight, padding if isinstance(padding, int) else None)
    for field, shape in (("bias", (n,)), ("input_scale", (k,))):
        if values[field] is not None:
            _check(values[field], shape, values[field].dtype, name, field, source)
    module = WeightOnlyLinear(weight, values["bias"], values["input_scale"],
                              from_transposed=bool(layer.get("transposed", False)))
    kernel, packed, _ = choose(weight, kernels, linear_weight(target).dtype)
    module.use_kernel(kernel, packed)
    info.kernels[name] = kernel.name
    return name, module


def _expected_shape(module: nn.Module, kind: Any) -> tuple[int, int] | None:
    conv1d = conv1d_class()
    linear = isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d))
    if kind == "linear" and linear:
        return tuple(linear_weight(module).shape)  # type: ignore[return-value]
    if kind == "embedding" and isinstance(module, nn.Embedding):
        return tuple(module.weight.shape)  # type: ignore[return-value]
    return None


def _check(tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, layer: str, field: str,
           source: Path) -> None:
    if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
        got = "missing" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"
        raise SerializationError(f"{source}: layer {layer!r} {field} should be {dtype} {shape}, got {got}",
                                 path=str(source))


def _load_float_state(model: nn.Module, info: WeightOnlyInfo, tensors: dict[str, torch.Tensor],
                      source: Path) -> None:
    state = {key[len(_FLOAT):]: value for key, value in tensors.items() if key.startswith(_FLOAT)}
    own = tuple(f"{name}." for name in info.layers)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [key for key in missing if not key.startswith(own)]
    if missing or unexpected:
        raise SerializationError(f"{source} does not fit the model given to qp.load: missing "
                                 f"{missing[:5]}, unexpected {unexpected[:5]} (build the model from the same "
                                 "class and config)", path=str(source))
