"""Quantize a fused graph with another mapping, reusing the observers calibrated for the first one.

A target search tries a few mappings (some layers out of static int8) on the same fused graph.
The values every mapping observes are the same nodes with the same names, so an observer
calibrated under one mapping holds the statistics another mapping's observer of the same value
would collect: the candidate is prepared, its observers are copied from the calibrated model,
and it is converted without running calibration again (dynamic observers have nothing to copy).
A static observer with no like counterpart (another dtype, range or observer class) makes the
candidate calibrate as usual.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import fx, nn

from qplug_core.flows import calibration_sample
from qplug_core.flows.prepare import is_observer_module

__all__ = ["calibrated_observers", "observed_with"]

_SAME = ("dtype", "quant_min", "quant_max", "qscheme", "ch_axis", "reduce_range")


def _observers(gm: fx.GraphModule) -> dict[str, str]:
    """observed value's name -> observer module target, for each static observer module's first
    use. A dynamic observer holds no statistics (its kernel measures each batch): there is
    nothing to copy, and a static observer of the same value is not its like."""
    found: dict[str, str] = {}
    seen: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target in seen or not node.args:
            continue
        module = gm.get_submodule(node.target)
        if is_observer_module(module) and not getattr(module, "is_dynamic", False) \
                and isinstance(node.args[0], fx.Node):
            seen.add(node.target)
            found.setdefault(node.args[0].name, node.target)
    return found


def _alike(a: nn.Module, b: nn.Module) -> bool:
    return type(a) is type(b) and all(getattr(a, k, None) == getattr(b, k, None) for k in _SAME)


def calibrated_observers(calibrated: fx.GraphModule) -> dict[str, nn.Module]:
    """observed value's name -> a copy of its calibrated observer: what :func:`observed_with`
    needs, kept apart so the calibrated model itself can be converted in place."""
    return {value: copy.deepcopy(calibrated.get_submodule(target))
            for value, target in _observers(calibrated).items()}


def _copy_observers(observed: fx.GraphModule, sources: dict[str, nn.Module]) -> bool:
    """Copy every observer of ``observed`` from ``sources``; False if one has no like source."""
    for value, target in _observers(observed).items():
        module = observed.get_submodule(target)
        source = sources.get(value)
        if source is None or not _alike(module, source):
            return False
        replacement = copy.deepcopy(source)
        replacement.name = module.name
        observed.set_submodule(target, replacement)
    return True


def observed_with(gm: fx.GraphModule, sources: dict[str, nn.Module], mapping: Any, inputs: tuple,
                  batches: list[tuple], backend: Any, prepare_options: dict[str, Any]
                  ) -> fx.GraphModule:
    """``gm`` prepared with ``mapping`` and calibrated: observers copied from ``sources`` (see
    :func:`calibrated_observers`; ``gm`` prepared with another mapping and calibrated on
    ``batches``) where all have a like counterpart, else by running ``batches``."""
    from qplug_core.algorithms.pipeline import prepare_sharing_weights
    from qplug_core.flows.steps import calibrate

    observed = prepare_sharing_weights(gm, mapping, inputs, backend, prepare_options)
    if not _copy_observers(observed, sources):
        observed = prepare_sharing_weights(gm, mapping, inputs, backend, prepare_options)
        calibrate(observed, batches, progress=False)
    else:
        calibration_sample.keep(observed, batches)  # what calibrating would have kept
    return observed
