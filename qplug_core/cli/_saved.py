"""Opening a file ``qp.save`` wrote, for the commands that take one (report, bench, export).

A converted graph model carries its own structure. A model quantized by module swap
(``qp.quantize_weights``, ``qp.quantize_w8a8``, per-token ``qp.quantize_dynamic``) is only its
int8 tensors: it is loaded into a model built by the float original's factory (``--float``), and
its report is read from the file alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from qplug_core.errors import ConfigError
from qplug_core.serialization.files import read_artifact_file
from qplug_core.serialization.weight_only import is_swapped_document

#: what each module-swap mode is called where the user reads it
_SWAP_MODES = {"weight_only": "weight-only", "w8a8": "W8A8", "dynamic": "per-token dynamic"}


def saved_document(path: Path) -> dict[str, Any]:
    """The JSON document of a saved model (what it was saved with, not what runs now)."""
    return json.loads(read_artifact_file(path)[0])


def load_saved(path: Path, float_spec: str | None, *, backend: str | None = None,
               command: str) -> nn.Module:
    """The model in ``path``; a module-swap file is loaded into a fresh model of ``float_spec``."""
    import qplug_core as qp
    from qplug_core.cli._inputs import load_factory_model

    document = saved_document(path)
    if not is_swapped_document(document):
        return qp.load(path, backend=backend)
    if float_spec is None:
        raise ConfigError(f"{path} holds a {swap_mode(document)} model (quantized by module swap): "
                          f"qplug {command} loads it into the float model it was made from; give --float "
                          "MODULE:FACTORY (a factory building that model, its class and config)",
                          field="--float")
    return qp.load(path, model=load_factory_model(float_spec), backend=backend)


def swap_mode(document: dict[str, Any]) -> str:
    return _SWAP_MODES.get(document.get("mode"), str(document.get("mode")))


def swapped_facts(document: dict[str, Any]) -> dict[str, Any]:
    """What a module-swap file holds, from its document: the scheme and the layers by kind."""
    layers: dict[str, int] = {}
    for layer in document.get("layers", []):
        layers[layer["kind"]] = layers.get(layer["kind"], 0) + 1
    facts: dict[str, Any] = {"mode": swap_mode(document), "int8_layers": layers}
    scheme = document.get("scheme")
    if scheme:
        group = scheme.get("group_size")
        facts["scheme"] = (f"int{scheme['bits']} {'symmetric' if scheme.get('symmetric') else 'asymmetric'}, "
                           + (f"groups of {group}" if group else "per channel"))
    for key in ("algorithm", "activations"):
        if document.get(key):
            facts[key] = document[key]
    if document.get("smoothed") is not None:
        # an input alpha="auto" chose not to smooth is listed with alpha None: nothing was folded
        facts["smoothed_groups"] = sum(1 for entry in document["smoothed"] if entry.get("alpha") is not None)
    if document.get("fused"):
        facts["fused_groups"] = len(document["fused"])
    if document.get("skipped"):
        facts["left_float"] = dict(document["skipped"])
    return facts


def backend_of(qmodel: nn.Module) -> str:
    """The backend a quantized model runs on: its report's, or a module-swap model's kernels'."""
    import qplug_core as qp
    from qplug_core.errors import QplugError

    try:
        return qp.quantization_report(qmodel).backend
    except QplugError:  # a module-swap model has no graph report: its kernels were picked per layer
        return "per-layer kernels"


def compared_layers(document: dict[str, Any]) -> set[str]:
    """The quantized layers, the rows worth ranking (a container repeats its last layer's figure)."""
    return {layer["name"] for layer in document["layers"]}
