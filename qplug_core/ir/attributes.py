"""The value a ``get_attr`` target names in a GraphModule (``"block.0.weight"``): one walk of the
dotted path, whatever the attribute is (parameter, buffer, plain tensor, submodule)."""

from __future__ import annotations

from typing import Any

from torch import fx


def fetch_attribute(gm: fx.GraphModule, target: str) -> Any:
    """``gm.<target>``; ``AttributeError`` when a part of the path is missing."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


__all__ = ["fetch_attribute"]
