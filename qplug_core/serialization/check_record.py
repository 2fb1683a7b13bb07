"""The final check's scores (the report's ``final_check``), as data in a saved file.

A model loaded from a file was checked against the float model when it was quantized; its report
says so again after ``qp.load`` and in ``qplug report``. The record is numbers and the names the
report prints (an output's name, a derived output's): nothing in it is resolved or run. A file
without it (written before it was kept) loads with no ``final_check``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from qplug_core.config.codec import child, expect, read_fields, where
from qplug_core.errors import ConfigError

KEY = "final_check"
_SCORES = ("cosine", "sqnr_db", "reference_cosine", "reference_sqnr_db", "derived_cosine")
_NAMES = ("output", "derived")
_REQUIRED = ("cosine", "sqnr_db", "reference_cosine", "reference_sqnr_db")
#: what the report prints as an output's name: ``last_hidden_state``, ``output[1]``, ``pooled embedding``
_NAME = re.compile(r"[A-Za-z0-9_.\[\] ]{1,128}\Z")


def to_document(check: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in check.items() if key in _SCORES + _NAMES}


def from_document(doc: Any, path: str) -> dict[str, Any]:
    """The checked record: finite numbers (or null where a score was not taken) and printable
    names; raises :class:`ConfigError` naming the bad field."""
    read_fields(doc, path, _SCORES + _NAMES, required=_REQUIRED)
    check: dict[str, Any] = {}
    for key, value in doc.items():
        at = child(path, key)
        if key in _NAMES:
            if not isinstance(value, str) or not _NAME.match(value):
                raise ConfigError(f"{where(at)}: {value!r} is not an output name", field=at, value=value)
        elif value is not None:
            expect(value, (int, float), at, "a number or null")
            if not math.isfinite(value):
                raise ConfigError(f"{where(at)}: {value!r} is not a finite number", field=at, value=value)
        check[key] = value
    for key in ("cosine", "sqnr_db"):
        if check[key] is None:
            raise ConfigError(f"{where(child(path, key))}: expected a number, got null", field=child(path, key),
                              value=None)
    if ("derived" in check) != ("derived_cosine" in check):
        raise ConfigError(f"{where(path)}: derived and derived_cosine go together", field=path, value=None)
    return check


__all__ = ["KEY", "from_document", "to_document"]
