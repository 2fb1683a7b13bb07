"""Whether a backend's own default qconfigs fit its own dtype configs: a ``qplug doctor`` finding.

A backend states its runtime's limits in two places: its dtype configs (7-bit activations,
weights in [-127, 127]) and the options of its default qconfig mapping (``qconfig_options``).
Where the two disagree, the backend listed as ok and its first ``qp.quantize`` with the defaults
raised NothingQuantizedError ("the backend cannot honour the qconfig"). Checked on the weighted
patterns, whose kernels are what a backend is for, with the qconfig its default gives each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qplug_core.errors import QplugError
from qplug_core.flows.regions import dtype_config_problems
from qplug_core.patterns import format_pattern
from qplug_core.registry.backends import get_backend, list_backends
from qplug_core.registry.contract import Diagnostic

if TYPE_CHECKING:
    from qplug_core.registry.backends import Backend

__all__ = ["default_contradictions", "default_fit_diagnostics"]

#: the qconfig_options key that moves each side's range
_FIX = {"activation": "reduce_range=True (activations in [0, 127])",
        "weight": "weight_quant_min / weight_quant_max (e.g. -127 for symmetric weights)"}


def default_contradictions(backend: Backend) -> list[str]:
    """One line per way the backend's default static/QAT qconfigs contradict its weighted
    patterns' dtype configs (empty: they agree, or the backend has no such default)."""
    found = []
    for mode in ("static", "qat"):
        try:
            mapping = backend.default_qconfig_mapping(mode)
        except QplugError:
            continue
        unfit: dict[str, list[str]] = {}  # first problem -> the patterns it rules out
        for config in backend.config.configs:
            static = [dc for dc in config.dtype_configs if not dc.is_dynamic and dc.weight_dtype is not None]
            if not static or config.root_module is None:
                continue
            qconfig = mapping.object_type_qconfigs.get(config.root_module, mapping.global_qconfig)
            if qconfig is None:
                continue
            problems = [dtype_config_problems(qconfig, dc, True) for dc in static]
            if all(problems):
                unfit.setdefault(problems[0][0], []).append(format_pattern(config.pattern_complex_format))
        for problem, patterns in unfit.items():
            side = problem.partition(":")[0]
            fix = f": set {_FIX[side]} in qconfig_options({mode!r})" if side in _FIX else ""
            found.append(f"its default {mode!r} qconfig contradicts its own dtype configs of "
                         f"{len(patterns)} weighted pattern(s) ({', '.join(patterns[:3])}"
                         f"{', ...' if len(patterns) > 3 else ''}): {problem}; qp.quantize with the "
                         f"defaults leaves them float{fix}")
    return found


def default_fit_diagnostics() -> list[tuple[str, Diagnostic]]:
    """``qplug doctor``'s findings: an error per contradiction of each usable backend."""
    findings = []
    for name in dict.fromkeys(info.name for info in list_backends() if info.available):
        try:
            backend = get_backend(name)
        except QplugError:
            continue
        findings += [(f"backend {name}", Diagnostic("error", line)) for line in default_contradictions(backend)]
    return findings
