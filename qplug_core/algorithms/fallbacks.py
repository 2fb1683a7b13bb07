"""What a layer taken out of static int8 becomes, chosen per CPU: the fallback ladder.

A target search takes the layers static int8 hurts most out of it. The best replacement depends
on the CPU (field notes, round 3):

* ``"per_token"``: int8 weights, one activation scale per token, float output
  (:class:`~qplug_core.kernels.per_token.PerTokenDynamicLinear`): as accurate as float on MiniLM's
  FFN outputs and fast wherever its GEMM is oneDNN's packed u8 x s8 linear: VNNI or AMX, and AVX2
  without VNNI with 7-bit weights (pair sums within int16; the layer errors are measured with
  them). Where only ``torch._int_mm`` is left (x86 without AVX2) it runs slower than fp32, so it
  is not offered there;
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
from qplug_core.flows.tags import ARTIFACT, REPORT, SNAPSHOT
from qplug_core.flows.target_rungs import RUNGS, name_rungs
from qplug_core.kernels.per_token import (
    PER_TOKEN_LAYERS,
    QMAX,
    best_gemm,
    per_token_is_fast,
    swap_in_per_token,
    weight_qmax,
)

__all__ = ["fallback_ladder", "name_fallbacks", "per_token_qmax", "run_per_token"]

def per_token_qmax(backend: Any = None) -> int:
    """The weight range a per-token layer gets on ``backend``: the GEMM's on this CPU, or the
    full one where it is simulated (a backend without kernels: the reference form)."""
    return weight_qmax(best_gemm()) if getattr(backend, "kernels", None) else QMAX


def fallback_ladder(backend: Any = None) -> tuple[str, ...]:
    """The rungs a layer out of static int8 may take on this CPU (and ``backend``: no per-token
    one for a backend that compiles partitions, no dynamic one for a backend without dynamic
    defaults), best first."""
    per_token = per_token_is_fast() and getattr(backend, "delegate", None) is None
    ladder = RUNGS if per_token else tuple(r for r in RUNGS if r != "per_token")
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
    replaced = {n.removesuffix(".0") for n in swap_in_per_token(qmodel, layers, simulate=simulate)}
    snapshot = snapshot_of(qmodel)
    if snapshot is not None:
        every = tuple(sorted({*snapshot.per_token_layers, *replaced}))
        qmodel.meta[SNAPSHOT] = dataclasses.replace(snapshot, per_token_layers=every)
        return
    artifact = qmodel.meta.get(ARTIFACT)  # a loaded model: its file's artifact (qp.save stores the
    if dataclasses.is_dataclass(artifact) and not isinstance(artifact, type):  # new layers' int8 weights)
        every = tuple(sorted({*artifact.model.get(PER_TOKEN_LAYERS, []), *replaced}))
        qmodel.meta[ARTIFACT] = dataclasses.replace(artifact, model={**artifact.model, PER_TOKEN_LAYERS: list(every)})


def name_fallbacks(qmodel: fx.GraphModule, taken: dict[str, str]) -> None:
    """Name in ``qmodel``'s report the rung each layer a target search took out of static int8
    runs on (layer -> rung), and keep them with its reference form for ``qp.save``."""
    name_rungs(qmodel.meta.get(REPORT), taken)
    snapshot = snapshot_of(qmodel)
    if snapshot is not None:
        qmodel.meta[SNAPSHOT] = dataclasses.replace(snapshot, target_rungs=dict(taken))
