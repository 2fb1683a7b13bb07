"""The float weight of each layer made from a functional call, as data in a saved file.

Such a layer (``conv2d_module``) has no module in the float model; ``qp.compare`` finds the float call
by the weight normalize recorded (:mod:`qplug_core.flows.normalize`). The record is layer path ->
weight path, two checked attribute paths: nothing in it is resolved or run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qplug_core.config.codec import child, expect, where
from qplug_core.errors import ConfigError
from qplug_core.serialization.graph_codec import check_path

KEY = "functional_weights"


def to_document(weights: Mapping[str, str]) -> dict[str, str]:
    return dict(sorted(weights.items()))


def from_document(doc: Any, path: str, max_entries: int) -> dict[str, str]:
    """The checked record: attribute paths, no more entries than the graph has nodes; raises
    :class:`ConfigError` naming the bad field."""
    entries = expect(doc, dict, path, "a JSON object")
    if len(entries) > max_entries:
        raise ConfigError(f"{where(path)}: {len(entries)} entries for a graph of {max_entries} nodes",
                          field=path, value=len(entries))
    return {check_path(layer, child(path, layer), "layer"): check_path(weight, child(path, layer), "weight")
            for layer, weight in entries.items()}
