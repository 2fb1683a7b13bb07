"""``qp.compare`` against the float model fused the way the quantized model was.

An int8 layer made from a fusion (conv + bn + relu) computes all of it under the name of its
first module; the float model's module of that name computes the conv alone. Paired as they were,
an unfused float model's conv-bn rows read -3..2 dB for 34-44 dB layers, without a word. When the
quantized model's fusion records (``FUSIONS``) name modules the float model still runs separately,
compare fuses the float model with the quantized model's backend first and says so; if it cannot,
those layers move to ``skipped`` with the reason.
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from qplug_core.errors import QplugError, first_line, warn_user
from qplug_core.flows.steps import fuse_fx
from qplug_core.flows.tags import FUSIONS, REPORT, STATE

__all__ = ["fused_like", "unfused_layers"]


def _meta(model: nn.Module) -> dict[str, Any]:
    return model.meta if isinstance(model, fx.GraphModule) else {}


def _backend(quantized_model: nn.Module) -> str | None:
    """The backend that fused ``quantized_model``: a loaded model has no prepare state, only the
    report qp.load's conversion attached (same backend name)."""
    meta = _meta(quantized_model)
    return meta.get(STATE, {}).get("backend") or getattr(meta.get(REPORT), "backend", None)


def unfused_layers(float_model: nn.Module, quantized_model: nn.Module) -> list[str]:
    """Layers of ``quantized_model`` made by fusing modules that ``float_model`` runs one by one."""
    # fusion records name graph nodes; a call_module node is named after its module path
    separate = {name.replace(".", "_") for name, _ in float_model.named_modules() if name}
    return [record.module_name for record in _meta(quantized_model).get(FUSIONS, [])
            if any(node in separate for node in record.nodes
                   if node != record.module_name.replace(".", "_"))]


def fused_like(float_model: nn.Module, quantized_model: nn.Module, example: tuple,
               unfused: list[str]) -> tuple[nn.Module, dict[str, str]]:
    """``(float model to compare against, layers to skip with the reason)`` for ``unfused``
    layers: ``float_model`` fused by the quantized model's backend, or, when that fails, the float
    model as given with those layers skipped."""
    named = ", ".join(unfused[:3]) + (", ..." if len(unfused) > 3 else "")
    backend = _backend(quantized_model)
    if backend is not None:
        try:
            fused = fuse_fx(float_model, example, backend=backend)
        except QplugError as error:
            reason = f"fusing float_model failed ({type(error).__name__}: {first_line(error)})"
        else:
            warn_user(f"compare(): the quantized model fused {named} (conv + bn/relu computed as one "
                      f"layer) but float_model runs them separately; comparing against "
                      f"qp.fuse_fx(float_model, backend={backend!r}) so each layer is paired with the "
                      "float ops it computes. Pass the fused float model to silence this")
            return fused, {}
    else:
        reason = "the quantized model does not say which backend fused it"
    warn_user(f"compare(): the quantized model fused {named} but float_model runs them separately, "
              f"and {reason}; those layers are not compared (see .skipped). Pass "
              "qp.fuse_fx(float_model, example_inputs, backend=...) as the float model")
    return float_model, {name: "the int8 layer computes a fusion (conv + bn/relu) that float_model "
                               "runs as separate modules; pass qp.fuse_fx(float_model, ...)"
                         for name in unfused}
