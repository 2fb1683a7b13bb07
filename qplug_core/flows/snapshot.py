"""The reference form of a converted model, kept as it was before lowering.

``qp.save`` writes the reference form (lowered kernels hold packed, engine-specific weights no
file can carry), and exporters and compilers start from it. Convert keeps it here as a
:class:`ReferenceSnapshot`, a second GraphModule over the same submodules (nothing is copied but
the graph): lowering swaps submodules of the converted model for kernels and never changes a
reference module, so the snapshot stays the reference form. Encoding it is serialization's job,
done only when the model is saved.

Once lowered, the model no longer runs most of those modules, and their float weights (on the
int8 grid) would keep the converted model larger in RAM than the float one: the snapshot then holds
each such weight as its int8 values (:func:`hold_weights_as_int8`), and its reference form is
rebuilt, bit-exact, each time it is read (:attr:`ReferenceSnapshot.graph_module`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from qplug_core import qparams as Q
from qplug_core.flows.tags import SNAPSHOT
from qplug_core.ir.copying import deepcopy_graph
from qplug_core.kernels.arithmetic import pair_sums_saturate
from qplug_core.kernels.reference import ReferenceWeighted, weight_of

if TYPE_CHECKING:
    from qplug_core.registry.backends import Backend


@dataclass(frozen=True, eq=False)
class ReferenceSnapshot:
    """``graph_module`` in reference form, converted for ``backend`` with these ``plugins``
    (name, dist, version of each contributing one: recorded now, the file says them later);
    ``per_token_layers``: float linears swapped for per-token dynamic ones after convert (an
    accuracy target's fallback), which ``qp.load`` swaps in again; ``int16_pairs``: the weights
    were chosen where the backend's kernels sum u8 x s8 pairs in int16 (x86 without VNNI), so
    ``qp.load`` on such a CPU keeps them as they are; ``target_rungs``: where each layer an
    accuracy target took out of static int8 runs (:mod:`qplug_core.flows.target_rungs`);
    ``held``: the reference form as held, where the ``ReferenceWeighted`` modules ``int8_weights``
    names (by path, with their weight's float dtype and ``requires_grad``) hold int8 values."""

    held: fx.GraphModule
    backend: str
    plugins: tuple[dict[str, str | None], ...]
    per_token_layers: tuple[str, ...] = ()
    int16_pairs: bool = False
    target_rungs: dict[str, str] = field(default_factory=dict)
    int8_weights: dict[str, tuple[torch.dtype, bool]] = field(default_factory=dict)

    @property
    def graph_module(self) -> fx.GraphModule:
        """The reference form, a model of its own (callers may rewrite it): a copy of ``held`` whose
        int8-held weights are float again, bit-exactly the weights convert rounded."""
        memo = {}
        for path, (dtype, requires_grad) in self.int8_weights.items():
            module = self.held.get_submodule(path)
            values = weight_of(module.module, module.weight_name)
            float_weight = Q.dequantize(values, module.weight_qparams).to(dtype)
            memo[id(values)] = nn.Parameter(float_weight, requires_grad=requires_grad)
        return deepcopy_graph(self.held, memo)


def keep_snapshot(gm: fx.GraphModule, backend: Backend) -> None:
    """Keep ``gm``'s reference form in ``gm.meta`` (call it between convert_graph and lowering)."""
    snapshot = fx.GraphModule(gm, deepcopy_graph(gm.graph), class_name=type(gm).__name__)
    snapshot.meta = dict(gm.meta)
    snapshot.train(gm.training)
    plugins = tuple({"name": r.name, "dist": r.dist, "version": r.version} for r in backend.contributors)
    gm.meta[SNAPSHOT] = ReferenceSnapshot(snapshot, backend.name, plugins,
                                          int16_pairs=pair_sums_saturate(backend.arithmetic))


def snapshot_of(gm: object) -> ReferenceSnapshot | None:
    """The snapshot a convert step kept in ``gm``, if any."""
    return getattr(gm, "meta", {}).get(SNAPSHOT) if isinstance(gm, fx.GraphModule) else None


def hold_weights_as_int8(gm: fx.GraphModule) -> None:
    """Let ``gm``'s snapshot hold the weights of the ``ReferenceWeighted`` modules ``gm`` no longer
    runs (lowered to kernels) as their int8 values: a quarter of the bytes. A weight its values do
    not give back bit-exactly stays float. Call it once ``gm`` is lowered."""
    snapshot = snapshot_of(gm)
    if snapshot is None:
        return
    running = _running_modules(gm)
    int8_weights = dict(snapshot.int8_weights)
    for node in snapshot.held.graph.nodes:
        if node.op != "call_module" or node.target in int8_weights:
            continue
        module = snapshot.held.get_submodule(node.target)
        if not isinstance(module, ReferenceWeighted) or id(module) in running:
            continue
        weight = weight_of(module.module, module.weight_name)
        held = _with_int8_weight(module, weight)
        if held is not None:  # a copy: whatever else holds the float module (a partition) keeps it
            snapshot.held.set_submodule(node.target, held)
            int8_weights[node.target] = (weight.dtype, weight.requires_grad)
    gm.meta[SNAPSHOT] = dataclasses.replace(snapshot, int8_weights=int8_weights)


def _running_modules(gm: fx.GraphModule) -> set[int]:
    """Ids of the modules ``gm`` may still run: its own and those of the reference forms its compiled
    partitions keep (for new input signatures). The snapshot shares them: an int8 copy of one would
    add to the float module, not replace it."""
    running = set()
    for module in gm.modules():
        running.add(id(module))
        partition = getattr(module, "partition", None)
        if isinstance(partition, nn.Module):
            running.update(id(inner) for inner in partition.modules())
    return running


def _with_int8_weight(module: ReferenceWeighted, weight: torch.Tensor) -> ReferenceWeighted | None:
    """A copy of ``module`` holding ``weight`` as its int8 values, or None where they would not give
    it back bit-exactly (a float16 weight, one changed after convert)."""
    qparams = module.weight_qparams
    if qparams.dtype not in Q.STORAGE_DTYPE or not isinstance(weight, nn.Parameter):
        return None
    values = torch.empty_like(weight, dtype=Q.STORAGE_DTYPE[qparams.dtype], requires_grad=False)
    for part, float_part in zip(Q.slices(values, qparams), Q.slices(weight.detach(), qparams)):
        part.copy_(Q.quantize(float_part, qparams))  # a slice at a time: temporaries of one slice
        if not torch.equal(Q.dequantize(part, qparams).to(weight.dtype), float_part):
            return None
    return copy.deepcopy(module, {id(weight): nn.Parameter(values, requires_grad=False)})
