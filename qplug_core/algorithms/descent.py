"""The target search's choices: which layers leave static int8, and which rung of the ladder each takes.

Groups (layers, or roles) are ranked by local static int8 error. The search alternates two moves,
first over the groups worse than the median layer, then over all of them:

* **out**: the worst 1, 2, 4, ... groups leave static int8, each layer on the cheapest rung of the
  ladder (:mod:`.fallbacks`, cheapest first) that at least halves its local error
  (:data:`MIN_GAIN`) or leaves it no worse than a layer staying in static int8; a rung that buys
  less does not move the end-to-end score (a 1000x input channel crushes a per-batch dynamic grid
  as much as the static one), so the layer goes float at once;
* **down**: while the model still misses the target with those groups out, the layers out with
  the worst local error on their rung move one rung down (1, 2, 4, ... of them; then all, and
  again), to the next rung with a smaller local error, float at the bottom.

So MiniLM's ``output.dense`` on a ladder (dynamic, float) stays dynamic when that meets the
target, although its dynamic error is above the static layers', and goes float (the worst layers
first) when it does not. Every try is one convert of the calibrated graph (``attempt``).
"""

from __future__ import annotations

from collections.abc import Callable

from qplug_core.algorithms.layer_errors import LayerError

__all__ = ["MIN_GAIN", "doubling", "group_error", "median", "rung_error", "search"]

#: a rung's local error must be at most this fraction of the layer's static int8 error to be tried
MIN_GAIN = 0.5

#: ``attempt(groups out, rung per layer out, first rung per layer)``: True if the converted model
#: meets the target, False if it misses it, None if not tried (every layer float: the float model)
Attempt = Callable[[list[list[str]], dict[str, str], dict[str, str]], "bool | None"]


def rung_error(error: LayerError, rung: str) -> float | None:
    """``error``'s layer's local error on ``rung`` (float: none; None: not measured, i.e. the rung
    does not apply to this layer, such as per-token for a conv)."""
    return 0.0 if rung == "float" else error.errors.get(rung)


def group_error(errors: list[LayerError], taken: dict[str, str]) -> float:
    """The mean local error of layers on the rungs ``taken`` gives them."""
    return sum(rung_error(e, taken[e.name]) or 0.0 for e in errors) / len(errors)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


def _first_rung(error: LayerError, ladder: tuple[str, ...], kept: float) -> str:
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


def doubling(first: int, total: int) -> list[int]:
    """1, 2, 4, ... up to ``first``, then doubling on to ``total`` (both included)."""
    sizes: list[int] = []
    k = 1
    while k <= total:
        sizes.append(k)
        if k == total:
            break
        k = min(2 * k, first) if k < first else min(2 * k, total)
    return sizes


def search(ranked: list[list[str]], worse: int, errors: dict[str, LayerError],
           ladder: tuple[str, ...], attempt: Attempt) -> None:
    """Try ``ranked`` groups out and their layers down ``ladder`` until ``attempt`` meets the
    target or would be the float model; ``worse``: how many groups are worse than the median
    layer (they go first)."""
    static = {n: errors[n].errors.get("static", 0.0) for g in ranked for n in g}
    middle = median(list(static.values()))
    first: dict[str, str] = {}
    taken: dict[str, str] = {}
    out: list[list[str]] = []
    sizes = doubling(worse, len(ranked))
    for stage in ([k for k in sizes if k <= worse], [k for k in sizes if k > worse]):
        for k in stage:  # out
            out = ranked[:k]
            gone = dict.fromkeys(n for g in out for n in g)  # ordered, with fast membership
            kept = max((v for n, v in static.items() if n not in gone), default=middle)
            first.update({n: _first_rung(errors[n], ladder, kept) for n in gone if n not in first})
            taken = {n: taken.get(n, first[n]) for n in gone}
            outcome = attempt(out, taken, first)
            if outcome is not False:
                return
        while True:  # down
            movable = sorted((n for n in taken if taken[n] != "float"),
                             key=lambda n: -(rung_error(errors[n], taken[n]) or 0.0))
            if not movable:
                break
            for m in doubling(len(movable), len(movable)):
                trial = dict(taken)
                trial.update({n: _next_rung(errors[n], ladder, taken[n]) for n in movable[:m]})
                outcome = attempt(out, trial, first)
                if outcome is not False:
                    return
            taken = trial
