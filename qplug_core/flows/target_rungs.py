"""Where each layer an accuracy target took out of static int8 runs, in the model's report.

The search converts those layers with qconfig ``None``, so convert's report called them "not
requested" (the user had asked for nothing) and counted per-token int8 layers as float compute.
The rungs are named here, per-token layers counted with the int8 ones on their kernel, and the
rungs travel in the saved file so that ``qp.load`` reports the same.
"""

from __future__ import annotations

from typing import Any

#: the report's reason for a layer a rung leaves in float (per-token layers count as int8)
RUNG_REASONS = {
    "dynamic": "the accuracy target took it out of static int8: it runs dynamic int8",
    "float": "the accuracy target took it out of static int8: it runs float",
}
#: every rung a layer may be taken to, best first
RUNGS = ("per_token", *RUNG_REASONS)
#: the report's kernel name of a per-token dynamic int8 layer
PER_TOKEN_KERNEL = "per-token dynamic int8 (accuracy target)"


def name_rungs(report: Any, rungs: dict[str, str]) -> None:
    """Update ``report`` (a QuantizationReport) for ``rungs`` (layer -> rung): a per-token layer
    moves from the float ops to the int8 ones, on :data:`PER_TOKEN_KERNEL`; another layer left
    float keeps its place with the rung as its reason."""
    if report is None:
        return
    for entry in list(report.skipped):
        rung = rungs.get(entry.node)
        if rung == "per_token":
            report.skipped.remove(entry)
            report.quantized[entry.node] = entry.op
            report.kernels[entry.node] = PER_TOKEN_KERNEL
        elif rung is not None:
            entry.reason = RUNG_REASONS[rung]


__all__ = ["PER_TOKEN_KERNEL", "RUNGS", "RUNG_REASONS", "name_rungs"]
