"""Which rung of the fallback ladder each layer out of static int8 takes, and when it moves down.

The ladder (:mod:`.fallbacks`) is ordered cheapest first: a layer taken out of static int8 first
tries the first rung that at least halves its local static int8 error (:data:`MIN_GAIN`) or leaves
it no worse than a layer staying in static int8; one that buys less does not move the end-to-end
score (a 1000x input channel crushes a per-batch dynamic grid as much as the static one), so the
layer goes float at once. A layer goes further down only while the converted model still
misses the target: worst local error first, one rung at a time, to the next rung with a smaller
local error (float at the bottom, exact). MiniLM's ``output.dense`` on a ladder (dynamic, float)
stays dynamic when that meets the target, although its dynamic error is above the static layers'.
"""

from __future__ import annotations

from qplug_core.algorithms.layer_errors import LayerError

__all__ = ["MIN_GAIN", "first_rung", "group_error", "move_down", "rung_error", "worst_first"]

#: a rung's local error must be at most this fraction of the layer's static int8 error to be tried
MIN_GAIN = 0.5


def rung_error(error: LayerError, rung: str) -> float | None:
    """``error``'s layer's local error on ``rung`` (float: none; None: not measured, i.e. the rung
    does not apply to this layer, such as per-token for a conv)."""
    return 0.0 if rung == "float" else error.errors.get(rung)


def first_rung(error: LayerError, ladder: tuple[str, ...], kept: float) -> str:
    """The cheapest rung of ``ladder`` that at least halves the layer's static int8 error or
    leaves it no worse than ``kept`` (the worst layer staying in static int8)."""
    bar = max(MIN_GAIN * error.errors.get("static", 0.0), kept)
    for rung in ladder:
        value = rung_error(error, rung)
        if value is not None and value <= bar:
            return rung
    return "float"


def _next_rung(error: LayerError, ladder: tuple[str, ...], current: str) -> str:
    """The first rung below ``current`` with a smaller local error (float at the bottom)."""
    now = rung_error(error, current) or 0.0
    below = ladder[ladder.index(current) + 1:] if current in ladder else ()
    for rung in below:
        value = rung_error(error, rung)
        if value is not None and value < now:
            return rung
    return "float"


def group_error(errors: list[LayerError], taken: dict[str, str]) -> float:
    """The mean local error of a group's layers on the rungs they take."""
    return sum(rung_error(e, taken[e.name]) or 0.0 for e in errors) / len(errors)


def worst_first(groups: list[list[str]], taken: dict[str, str],
                by_name: dict[str, LayerError]) -> list[list[str]]:
    """The groups with a layer not yet float, worst mean local error on their rungs first."""
    movable = [g for g in groups if any(taken[n] != "float" for n in g)]
    return sorted(movable, key=lambda g: -group_error([by_name[n] for n in g], taken))


def move_down(taken: dict[str, str], groups: list[list[str]], by_name: dict[str, LayerError],
              ladder: tuple[str, ...]) -> dict[str, str]:
    """``taken`` with every layer of ``groups`` one rung further down the ladder."""
    moved = dict(taken)
    for name in (n for g in groups for n in g if taken[n] != "float"):
        moved[name] = _next_rung(by_name[name], ladder, taken[name])
    return moved
