"""A converted model's reference form finished again: on another backend (``backend="auto"``'s
candidates) or on its own with some regions kept in reference form (the final check's mend).

Both start from the :class:`~qplug_core.flows.snapshot.ReferenceSnapshot` convert kept, a deep
copy of it each time, so the model finished before is left as it was.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from torch import fx

from qplug_core.flows.finish import finish_conversion
from qplug_core.flows.snapshot import ReferenceSnapshot, keep_snapshot, snapshot_of
from qplug_core.flows.tags import EXAMPLE_INPUTS, RECIPE, REPORT, SNAPSHOT, STATE, TARGET
from qplug_core.kernels.per_token import swap_in_per_token

if TYPE_CHECKING:
    from qplug_core.registry.backends import Backend


def finish_on(snapshot: ReferenceSnapshot, backend: Backend, base_model: fx.GraphModule, *,
              keep_reference: dict[str, str] | None = None, keep_regions: dict[str, str] | None = None,
              checked_on: tuple | None = None) -> fx.GraphModule:
    """A deep copy of ``snapshot``'s reference form lowered (or delegated) to ``backend``, as
    ``qp.quantize(backend=...)`` would leave it: its own snapshot, report and per-token layers.
    ``keep_reference`` and ``keep_regions`` keep those regions in reference form (as ``qp.load``
    does); ``checked_on``: the inputs the kernel contract runs on instead of the example inputs."""
    gm = snapshot.graph_module
    keep_snapshot(gm, backend)
    example = gm.meta.get(EXAMPLE_INPUTS)
    if checked_on is not None:
        gm.meta[EXAMPLE_INPUTS] = checked_on
    try:
        finish_conversion(gm, backend, mode=gm.meta.get(STATE, {}).get("mode", "static"),
                          keep_reference=keep_reference, keep_regions=keep_regions)
    finally:
        if example is not None:
            gm.meta[EXAMPLE_INPUTS] = example
        else:
            gm.meta.pop(EXAMPLE_INPUTS, None)
    if snapshot.per_token_layers:
        swap_in_per_token(gm, list(snapshot.per_token_layers), simulate=not backend.kernels)
        kept = snapshot_of(gm)
        if kept is not None:  # keep_snapshot put it there: qp.save must swap them in at load too
            gm.meta[SNAPSHOT] = dataclasses.replace(kept, per_token_layers=snapshot.per_token_layers)
    for key in (RECIPE, TARGET):
        if key in base_model.meta:
            gm.meta[key] = base_model.meta[key]
    if REPORT in base_model.meta:
        gm.meta[REPORT].recipe = base_model.meta[REPORT].recipe
    return gm


__all__ = ["finish_on"]
