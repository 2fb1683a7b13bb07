"""The clamps convert absorbed into a layer's int8 output range, as data in a saved file.

``qp.compare`` pairs such a layer (a conv whose ReLU6 convert dropped) with the float value after the
clamp (:mod:`qplug_core.flows.clamps`); a loaded model without the record paired it with the
unclamped value again. The record is layer path -> bounds and the names the comparison prints:
nothing in it is resolved or run, an unbounded side is ``null`` (JSON has no infinity).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from qplug_core.config.codec import child, expect, where
from qplug_core.errors import ConfigError
from qplug_core.flows.clamps import AbsorbedClamp
from qplug_core.serialization.graph_codec import check_path, layer_entries

KEY = "absorbed_clamps"
_FIELDS = ("low", "high", "op", "module")
#: what the float model ran, as printed: a class name (``ReLU6``) or a function's (``clamp``)
_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,63}\Z")


def to_document(clamps: Mapping[str, AbsorbedClamp]) -> dict[str, Any]:
    return {layer: {"low": _bound(c.low), "high": _bound(c.high), "op": c.op, "module": c.module}
            for layer, c in sorted(clamps.items())}


def _bound(value: float) -> float | None:
    return value if math.isfinite(value) else None


def from_document(doc: Any, path: str, max_entries: int) -> dict[str, AbsorbedClamp]:
    """The checked record: layer and module paths, finite bounds in order, no more entries than
    the graph has nodes; raises :class:`ConfigError` naming the bad field."""
    clamps = {}
    for layer, entry, at in layer_entries(doc, path, max_entries, _FIELDS):
        low = _read_bound(entry["low"], child(at, "low"), -math.inf)
        high = _read_bound(entry["high"], child(at, "high"), math.inf)
        if not low <= high:
            raise ConfigError(f"{where(at)}: low bound {low} is above high bound {high}", field=at, value=low)
        op = entry["op"]
        if not isinstance(op, str) or not _OP_NAME.match(op):
            raise ConfigError(f"{where(child(at, 'op'))}: {op!r} is not an op name", field=child(at, "op"), value=op)
        module = entry["module"]
        if module is not None:
            check_path(module, child(at, "module"), "clamp module")
        clamps[layer] = AbsorbedClamp(low, high, op, module)
    return clamps


def _read_bound(value: Any, path: str, unbounded: float) -> float:
    if value is None:
        return unbounded
    number = float(expect(value, (int, float), path, "a number or null"))
    if not math.isfinite(number):
        raise ConfigError(f"{where(path)}: {value!r} is not a finite number (null: unbounded)",
                          field=path, value=value)
    return number
