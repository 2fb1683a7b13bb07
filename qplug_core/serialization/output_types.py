"""The keyed container classes a saved file may name around a model's outputs, and nothing else.

A file is untrusted, so such a name is only looked up here, never imported or walked: it is
``collections.OrderedDict``, or ``transformers.modeling_outputs.<Name>`` (a Hugging Face
``ModelOutput``), found among the attributes of that one module, which qplug imports by its fixed
name when ``transformers`` is installed, and used only if it is a ``ModelOutput`` class defined
there. Any other name is not resolved: the caller builds a dict and says so.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from collections import OrderedDict
from typing import Any

from qplug_core.serialization.values import check_public

_HF_OUTPUTS = "transformers.modeling_outputs"


def name_of(cls: Any) -> str | None:
    """The name a file gives ``cls``: OrderedDict and ModelOutput classes (any, so that a load
    can name what it does not build), None for every other container."""
    if cls is OrderedDict:
        return "collections.OrderedDict"
    generic = sys.modules.get("transformers.utils.generic")  # imported if a model returned one
    if generic is not None and isinstance(cls, type) and issubclass(cls, generic.ModelOutput):
        return f"{cls.__module__}.{cls.__qualname__}"
    return None


def resolve(name: str, keys: list[Any], path: str) -> tuple[type | None, str]:
    """The class ``name`` stands for, holding ``keys``, or None and why it is not built."""
    if name == "collections.OrderedDict":
        return OrderedDict, ""
    module, _, attribute = name.rpartition(".")
    if module != _HF_OUTPUTS:
        return None, f"qp.load builds only collections.OrderedDict and the classes of {_HF_OUTPUTS}"
    check_public(attribute, path, "output class")
    if importlib.util.find_spec("transformers") is None:
        return None, "transformers is not installed"
    try:
        found: Any = vars(importlib.import_module(_HF_OUTPUTS)).get(attribute)
        base = importlib.import_module("transformers.utils").ModelOutput
    except ImportError as exc:
        return None, f"{_HF_OUTPUTS} does not import: {exc}"
    if not (isinstance(found, type) and issubclass(found, base) and found.__module__ == _HF_OUTPUTS):
        return None, f"the installed {_HF_OUTPUTS} has no ModelOutput class of that name"
    unknown = set(keys) - {field.name for field in dataclasses.fields(found)}
    if unknown:
        return None, f"the installed class has no field {', '.join(sorted(map(repr, unknown)))}"
    return found, ""
