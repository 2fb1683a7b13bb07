"""What a layer taken out of static int8 becomes, chosen per CPU: the fallback ladder.

A target search takes the layers static int8 hurts most out of it. The best replacement depends
on the CPU (field notes, round 3):

* ``"per_token"``: int8 weights, one activation scale per token, float output
  (:class:`~qplug_core.kernels.per_token.PerTokenDynamicLinear`): as accurate as float on MiniLM's
  FFN outputs and fast where the CPU multiplies u8 x s8 exactly (VNNI); without VNNI its GEMM
  falls back to ``torch._int_mm`` at 25x fp32's latency, so it is not offered there;
* ``"dynamic"``: the backend's per-tensor dynamic linear (int8 weights, one activation scale per
  batch): fast everywhere, but 7-bit activations on CPUs without VNNI (fbgemm's rule) make it weak
  on outlier-heavy inputs;
* ``"float"``: always exact, the last rung.

For each layer the search takes the first rung of :func:`fallback_ladder` whose measured local
error is as small as a typical static int8 layer's (``qplug_core.algorithms.layer_errors``), so
the default target holds on CPUs with and without VNNI.

A backend that compiles partitions (onnxruntime, openvino) has no per-token rung: the per-token
module is swapped in after convert, and a compiled partition runs the reference form it was
compiled from, so the layer would run float inside it while the decision said per-token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import fx

from qplug_core.errors import ConfigError
from qplug_core.flows.snapshot import snapshot_of
from qplug_core.flows.tags import ARTIFACT, SNAPSHOT
from qplug_core.kernels.cpu import cpu_int8
from qplug_core.kernels.per_token import PER_TOKEN_LAYERS, onednn_usable, swap_in_per_token

__all__ = ["LADDER_FALLBACKS", "cpu_has_vnni", "fallback_ladder", "run_per_token"]

#: every rung a ladder can hold, best first
LADDER_FALLBACKS = ("per_token", "dynamic", "float")


def cpu_has_vnni() -> bool:
    """Whether this CPU multiplies u8 x s8 into int32 exactly and fast (VNNI or AMX): where
    per-token dynamic beats per-tensor (the one place the target search asks the CPU fact)."""
    cpu = cpu_int8()
    return (cpu.vnni or cpu.amx) and onednn_usable(cpu)


def fallback_ladder(backend: Any = None) -> tuple[str, ...]:
    """The rungs a layer out of static int8 may take on this CPU (and ``backend``: no per-token
    one for a backend that compiles partitions, no dynamic one for a backend without dynamic
    defaults), best first."""
    per_token = cpu_has_vnni() and getattr(backend, "delegate", None) is None
    ladder = LADDER_FALLBACKS if per_token else ("dynamic", "float")
    return ladder if _has_dynamic_defaults(backend) else tuple(r for r in ladder if r != "dynamic")


def _has_dynamic_defaults(backend: Any) -> bool:
    if backend is None:
        return True
    try:
        backend.default_qconfig_mapping("dynamic")
    except ConfigError:
        return False
    return True


def run_per_token(qmodel: fx.GraphModule, layers: list[str], *, simulate: bool) -> None:
    """Swap per-token dynamic linears in for the float ``layers`` of a converted model and record
    them with its reference form, so that ``qp.load`` swaps them in again."""
    if not layers:
        return
    replaced = tuple(sorted(n.removesuffix(".0") for n in swap_in_per_token(qmodel, layers, simulate=simulate)))
    snapshot = snapshot_of(qmodel)
    if snapshot is not None:
        qmodel.meta[SNAPSHOT] = dataclasses.replace(snapshot, per_token_layers=replaced)
        return
    artifact = qmodel.meta.get(ARTIFACT)  # a loaded model: its file's artifact
    if dataclasses.is_dataclass(artifact) and not isinstance(artifact, type):
        model = {**artifact.model, PER_TOKEN_LAYERS: list(replaced)}
        qmodel.meta[ARTIFACT] = dataclasses.replace(artifact, model=model)
