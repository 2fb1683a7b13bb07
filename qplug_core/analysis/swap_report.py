"""``qp.quantization_report`` of any quantized model: a converted graph carries the report convert
made; a model quantized by module swap (``qp.quantize_weights``, ``qp.quantize_w8a8``, and so
``qp.quantize`` on a decoder LLM) gets one read from its own record, in the same type, so that it
prints, compares and serialises as a graph's does.
"""

from __future__ import annotations

from torch import nn

from qplug_core.flows.report import MODULE_SWAP, QuantizationReport, SkippedNode
from qplug_core.flows.steps import quantization_report as graph_report
from qplug_core.flows.tags import W8A8, WEIGHT_ONLY
from qplug_core.serialization.weight_only import swapped_facts, swapped_layers

#: facts the report holds in fields of its own, not in ``record``
_IN_FIELDS = ("mode", "int8_layers", "left_float")


def quantization_report(model: nn.Module) -> QuantizationReport:
    """What quantizing ``model`` did: int8 regions, kernels and every op left in float with why (a
    converted graph); or, for a model quantized by module swap, each layer quantized (name -> kind),
    its kernel, the scheme or smoothing, and each layer left float with why."""
    if not (hasattr(model, WEIGHT_ONLY) or hasattr(model, W8A8)):
        return graph_report(model)  # type: ignore[arg-type]  # it says what a model without a report is
    mode, kinds, entries = swapped_layers(model)
    facts = swapped_facts({"mode": mode, "layers": [{"name": n, "kind": k} for n, k in kinds.items()], **entries})
    record = {key: value for key, value in facts.items() if key not in _IN_FIELDS}
    weight_only = getattr(model, WEIGHT_ONLY, None)
    if weight_only is not None:
        kernels = dict(weight_only.kernels)
        record["fusion"] = weight_only.fusion
    else:
        w8a8 = getattr(model, W8A8)
        kernels = dict.fromkeys(kinds, w8a8.gemm)
        record["smoothed_into"] = {entry.into: f"(alpha {entry.alpha})" for entry in w8a8.smoothed}
        if w8a8.unsmoothed:
            record["not_smoothed"] = f"{len(w8a8.unsmoothed)} int8 layer(s), why in .{W8A8}.unsmoothed"
    modules = dict(model.named_modules())
    skipped = [SkippedNode(name, type(modules.get(name)).__name__, why)
               for name, why in facts.get("left_float", {}).items()]
    return QuantizationReport(backend="per-layer kernels", mode=facts["mode"], quantized=kinds, kernels=kernels,
                              skipped=skipped, capture=MODULE_SWAP, record=record)
