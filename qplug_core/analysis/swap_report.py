"""``qp.quantization_report`` of any quantized model: a converted graph carries the report convert
made; a model quantized by module swap (``qp.quantize_weights``, ``qp.quantize_w8a8``, and so
``qp.quantize`` on a decoder LLM) gets one read from its own record, in the same type, so that it
prints, compares and serialises as a graph's does. ``qp.quantize_dynamic``'s module swap keeps no
record: its report is read from the modules (the int8 kernels, the layers it could swap that
are still float, and the embedding tables, which it has no kernel for).
"""

from __future__ import annotations

from torch import nn

from qplug_core.flows.dynamic import DYNAMIC_TYPES, FLOAT_TABLE, TABLE_TYPES, SimulatedDynamic
from qplug_core.flows.report import MODULE_SWAP, QuantizationReport, SkippedNode
from qplug_core.flows.steps import quantization_report as graph_report
from qplug_core.flows.tags import DYNAMIC_LEFT_FLOAT, W8A8, WEIGHT_ONLY
from qplug_core.kernels.dynamic import DynamicKernel
from qplug_core.kernels.per_token import PerTokenDynamicLinear
from qplug_core.serialization.weight_only import swapped_facts, swapped_layers

#: facts the report holds in fields of its own, not in ``record``
_IN_FIELDS = ("mode", "int8_layers", "left_float")


def quantization_report(model: nn.Module) -> QuantizationReport:
    """What quantizing ``model`` did: int8 regions, kernels and every op left in float with why (a
    converted graph); or, for a model quantized by module swap, each layer quantized (name -> kind),
    its kernel, the scheme or smoothing, and each layer left float with why."""
    if not (hasattr(model, WEIGHT_ONLY) or hasattr(model, W8A8)):
        if isinstance(model, nn.Module) and not hasattr(model, "graph") and _dynamic_kernels(model):
            return _dynamic_report(model)
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


_DYNAMIC = (DynamicKernel, PerTokenDynamicLinear, SimulatedDynamic)
_NOT_NAMED = "left float: qp.quantize_dynamic swaps the layers its qconfig_spec names, not this one"
_IN_ATTENTION = ("nn.MultiheadAttention computes with its projections' weights directly, so no module "
                 "swap reaches them (qp.quantize or backend='onnxruntime' quantizes them)")


def _dynamic_kernels(model: nn.Module) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if isinstance(module, _DYNAMIC)}


def _kernel_name(module: nn.Module) -> str:
    if isinstance(module, PerTokenDynamicLinear):
        return f"{type(module).__name__} (per-token int8 activations)"
    if isinstance(module, SimulatedDynamic):
        return f"{type(module).__name__} (reference: int8 rounding simulated in float)"
    dtype = str(module.dtype).removeprefix("torch.")
    return f"{type(module).__name__} ({dtype} weights, {module.engine})"


def _dynamic_report(model: nn.Module) -> QuantizationReport:
    """A ``qp.quantize_dynamic`` model's report: each swapped layer with its kernel, and each layer
    of a type it converts that is still float (outside every swapped one)."""
    kernels = _dynamic_kernels(model)
    inside = tuple(f"{name}." for name in kernels)
    attention = tuple(f"{name}." for name, module in model.named_modules()
                      if isinstance(module, nn.MultiheadAttention))
    skipped = [SkippedNode(name, type(module).__name__, _IN_ATTENTION if name.startswith(attention)
                           else FLOAT_TABLE if isinstance(module, TABLE_TYPES)
                           else module.__dict__.get(DYNAMIC_LEFT_FLOAT, _NOT_NAMED))
               for name, module in model.named_modules()
               if isinstance(module, DYNAMIC_TYPES + TABLE_TYPES) and not name.startswith(inside)]
    engines = sorted({module.engine for module in kernels.values() if isinstance(module, DynamicKernel)}
                     | {"reference" for module in kernels.values() if isinstance(module, SimulatedDynamic)})
    return QuantizationReport(backend=", ".join(engines) or "per-layer kernels", mode="dynamic",
                              quantized={name: type(m).__name__ for name, m in kernels.items()},
                              kernels={name: _kernel_name(m) for name, m in kernels.items()},
                              skipped=skipped, capture=MODULE_SWAP)
