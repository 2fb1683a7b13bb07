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
from qplug_core.serialization.files import read_artifact_document
from qplug_core.serialization.weight_only import is_swapped_document, swap_mode


def saved_document(path: Path, *, verify: bool = False) -> dict[str, Any]:
    """The JSON document of a saved model (what it was saved with, not what runs now), read from
    the file's header as plain data; checked against the file's digest with ``verify`` (loading the
    model always checks it)."""
    return json.loads(read_artifact_document(path, verify=verify))


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
