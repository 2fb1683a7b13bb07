"""The target search's choices on known local errors: cheapest rung first, down the ladder only
while the target is missed, worst layers first, the roles worse than the median before the rest.

The end-to-end check is a stand-in whose answer is known: the model "meets the target" when the
sum of its layers' local errors is within a budget (the real search converts and scores)."""

from __future__ import annotations

import pytest

from qplug_core.algorithms.descent import rung_error, search
from qplug_core.algorithms.layer_errors import LayerError

LADDER = ("dynamic", "float")
#: output.dense-like role: static int8 crushes it, dynamic is fine for a2, worse for a0 and a1
#: (above every static layer kept); b: mild; c: the best static layers, worse as dynamic
ERRORS = {**{f"a{i}": {"static": 0.5, "dynamic": d} for i, d in enumerate((4e-3, 4e-3, 1e-3))},
          **{f"b{i}": {"static": 2e-3, "dynamic": 1e-3} for i in range(3)},
          **{f"c{i}": {"static": 1e-3, "dynamic": 3e-3} for i in range(3)}}
RANKED = [[f"{role}{i}" for i in range(3)] for role in "abc"]


def _run(budget: float) -> list[dict[str, str]]:
    errors = {n: LayerError(n, dict(e)) for n, e in ERRORS.items()}
    tries: list[dict[str, str]] = []

    def attempt(out, taken, first):
        tries.append(dict(taken))
        if len(taken) == len(errors) and set(taken.values()) == {"float"}:
            return None  # the float model: target.py does not convert it, the search stops
        total = sum(rung_error(errors[n], taken[n]) if n in taken else e.errors["static"]
                    for n, e in errors.items())
        return total <= budget

    search(RANKED, 1, errors, LADDER, attempt)
    return tries


@pytest.mark.parametrize("budget, tries, answer", [
    # a as dynamic meets it although a0's dynamic error is above every static layer's
    (0.02, 1, dict.fromkeys(("a0", "a1", "a2"), "dynamic")),
    # missed with a dynamic: a0, then a0 and a1 (the worst) go float; a2 stays dynamic
    (0.012, 3, {"a0": "float", "a1": "float", "a2": "dynamic"}),
    # missed with all of a float: b follows on its cheapest rung; c stays static int8
    (0.0065, 5, {**dict.fromkeys(("a0", "a1", "a2"), "float"), **dict.fromkeys(("b0", "b1", "b2"), "dynamic")}),
])
def test_the_search_takes_the_cheapest_rungs_that_meet_the_target(budget, tries, answer):
    found = _run(budget)
    assert len(found) == tries and found[-1] == answer


def test_a_search_that_cannot_meet_the_target_stops_at_the_float_model():
    found = _run(0.0)
    assert found[-1] == dict.fromkeys(ERRORS, "float")  # offered, not converted; nothing after it
    assert len(found) == len({tuple(sorted(t.items())) for t in found})  # no state tried twice
    assert len(found) <= 12  # a few converts, not one per layer and rung
