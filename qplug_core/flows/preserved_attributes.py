"""The attributes a user keeps on the captured model: torch.ao's ``preserved_attributes``.

A GraphModule holds only what ``forward`` uses, so ``model.labels`` read by serving code is gone
after capture. The names given as ``preserved_attributes=`` (or in torch.ao's custom configs) are
set on the fused, prepared or converted model as torch.ao sets them, and listed in
``GraphModule.meta`` under torch.fx's own key, from which ``copy.deepcopy`` of a GraphModule sets
them again on the copy: the attributes kept at prepare stay on the converted model too.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from torch import fx, nn

from qplug_core.errors import ConfigValidationError, did_you_mean, warn_user

#: GraphModule.meta key of torch.fx (torch/fx/graph_module.py), not qplug's: name -> value of the
#: attributes kept; GraphModule.__deepcopy__ sets them on the copy
PRESERVED = "_user_preserved_attributes"


def attribute_names(names: Any) -> tuple[str, ...]:
    """``preserved_attributes`` as a tuple of names (a bare string is refused: it is not a list)."""
    listed = () if isinstance(names, str) or not isinstance(names, Iterable) else tuple(names)
    if not all(isinstance(name, str) for name in listed) or (names and not listed):
        raise ConfigValidationError(
            f"preserved_attributes must be a list of attribute names, e.g. ['labels'], got {names!r}",
            field="preserved_attributes", value=names)
    return tuple(dict.fromkeys(listed))


def preserve(gm: fx.GraphModule, source: nn.Module, names: Any, *, copy_modules: bool) -> None:
    """Set ``source``'s attributes ``names`` on ``gm`` with those ``gm`` already keeps (read anew
    from ``source``, which may have changed them), as torch.ao does: a value is shared, but a module
    is copied where ``copy_modules`` (``train()``, ``to()`` on ``gm`` would reach the user's own)."""
    kept = dict(gm.meta.get(PRESERVED, {}))
    wanted = attribute_names(names)
    if not wanted and not kept:
        return
    missing = [name for name in wanted if not hasattr(source, name)]
    if missing:
        have = [name for name in vars(source) if not name.startswith("_")]
        warn_user(f"qplug: preserved_attributes names {', '.join(map(repr, missing))}, which this "
                  f"{type(source).__name__} does not have{did_you_mean(missing[0], have)}; nothing is kept "
                  "for it")
    clashes = [name for name in wanted if name not in kept and hasattr(gm, name) and gm is not source]
    if clashes:
        raise ConfigValidationError(
            f"preserved_attributes names {clashes[0]!r}, which the captured GraphModule has as its own "
            f"({type(getattr(gm, clashes[0])).__name__}): keeping the model's would replace it; keep "
            "only attributes forward() does not use", field="preserved_attributes", value=clashes[0])
    values = {name: getattr(source, name) for name in (*kept, *wanted) if hasattr(source, name)}
    if copy_modules:
        values = {name: copy.deepcopy(value) if isinstance(value, nn.Module) else value
                  for name, value in values.items()}
    for name in kept.keys() - values.keys():
        delattr(gm, name)  # the user deleted it from ``source``
    gm.meta[PRESERVED] = values
    for name, value in values.items():
        setattr(gm, name, value)


def preserved_names(model: nn.Module) -> list[str]:
    """The names of the attributes ``model`` keeps (``[]`` for a model not from qplug's flows)."""
    return list(getattr(model, "meta", {}).get(PRESERVED, {}))


__all__ = ["PRESERVED", "attribute_names", "preserve", "preserved_names"]
