"""Say so when a backend's prepare pass narrows the activation range a user's own qconfig asked for.

fbgemm gives every value that feeds a depthwise conv 7 bits, whatever the qconfig says: its
depthwise kernels saturate int16 pair sums on 8-bit inputs. With the backend's default qconfig
that is the backend's own choice; a user who wrote an 8-bit observer (a torch.ao oracle comparison
relies on it) got 7 bits without a word. Each post-prepare plugin pass is watched: the observers
whose range it narrowed, where the qconfig in force is the user's and not the backend's default,
are named in one warning and in the report's notes, with the pass's own reason (the first line
of its docstring).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import fx

from qplug_core.errors import warn_user
from qplug_core.flows.observed import observed_values
from qplug_core.flows.tags import CONVERSION_NOTES, region_tag
from qplug_core.passes.base import PassResult


def _ranges(gm: fx.GraphModule) -> dict[str, tuple[int, int]]:
    """observer node name -> its (quant_min, quant_max)."""
    return {found.node.name: (int(found.observer.quant_min), int(found.observer.quant_max))
            for found in observed_values(gm) if hasattr(found.observer, "quant_max")}


def _bits(bounds: tuple[int, int]) -> int:
    return math.ceil(math.log2(bounds[1] - bounds[0] + 1))


def warn_narrowed(backend: str, pass_: Callable, old: tuple[int, int], new: tuple[int, int],
                  layers: list[str]) -> str:
    """Warn once that ``backend``'s prepare pass ``pass_`` gave the inputs of ``layers`` the range
    ``new`` where the user's qconfig asked ``old`` (graph and eager mode); the text, for a report."""
    why = (pass_.__doc__ or pass_.__name__).strip().splitlines()[0]
    listed = ", ".join(map(repr, layers[:5])) + (f" and {len(layers) - 5} more" if len(layers) > 5 else "")
    text = (f"{backend} gave the input of {len(layers)} layer(s) {_bits(new)} bits (codes {new[0]}..{new[1]}) "
            f"where your qconfig asks {_bits(old)} ({old[0]}..{old[1]}): {listed}. Why ({backend}'s "
            f"prepare pass {pass_.__name__}): {why}")
    warn_user(f"qplug: {text}")
    return text


def reporting_narrowed(backend: str, passes: list[Callable], *, users_own: bool, default_qconfig: Any
                       ) -> list[Callable]:
    """``passes`` (the backend's post-prepare passes), each followed by a check that warns once
    and notes in the report which layers' inputs it narrowed against the user's own qconfig
    (``users_own``: the mapping is the user's; a qconfig equal to ``default_qconfig`` is not)."""
    if not users_own:
        return passes
    return [step for pass_ in passes for step in _watched(backend, pass_, default_qconfig)]


def _watched(backend: str, pass_: Callable, default_qconfig: Any) -> list[Callable]:
    before: dict[str, tuple[int, int]] = {}

    def remember(gm: fx.GraphModule) -> PassResult:
        before.clear()
        before.update(_ranges(gm))
        return PassResult(gm, False)

    def check(gm: fx.GraphModule) -> PassResult:
        asked: dict[tuple[int, int], tuple[int, int]] = {}
        layers: list[str] = []
        after = _ranges(gm)
        for found in observed_values(gm):
            old, new = before.get(found.node.name), after.get(found.node.name)
            if old is None or new is None or new == old:
                continue
            qconfigs = [tag.qconfig for user in found.node.users if (tag := region_tag(user)) is not None]
            if any(q is not None and q.activation != getattr(default_qconfig, "activation", None) for q in qconfigs):
                asked[old] = new
                layers += [str(user.target) for user in found.node.users if user.op == "call_module"]
        if asked:
            (old, new), *_ = asked.items()
            gm.meta.setdefault(CONVERSION_NOTES, []).append(warn_narrowed(backend, pass_, old, new, layers))
        return PassResult(gm, False)

    remember.__name__, check.__name__ = f"before_{pass_.__name__}", f"narrowed_by_{pass_.__name__}"
    return [remember, pass_, check]


__all__ = ["reporting_narrowed", "warn_narrowed"]
