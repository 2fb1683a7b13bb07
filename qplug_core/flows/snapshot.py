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
rebuilt, bit-exact, each time it is read (:attr:`ReferenceSnapshot.graph_module`), as compiled
partitions hold theirs (:mod:`qplug_core.kernels.held_int8`). Lowering swaps each layer as soon as
its kernel replaces it (:func:`hold_weight_as_int8`): swapped only at the end, every layer's float
weight, its packed kernel and its int8 copy were all alive at once, the peak of ``qp.quantize``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import fx

from qplug_core.flows.tags import SNAPSHOT
from qplug_core.ir.copying import deepcopy_graph
from qplug_core.kernels.arithmetic import pair_sums_saturate
from qplug_core.kernels.held_int8 import Copies, float_form, hold_as_int8, hold_module_as_int8

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
        return float_form(self.held, self.int8_weights)


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


def hold_weights_as_int8(gm: fx.GraphModule, copies: Copies) -> None:
    """Let ``gm``'s snapshot hold the weights of the ``ReferenceWeighted`` modules ``gm`` no longer
    runs itself (lowered to kernels, taken by compiled partitions) as their int8 values: a quarter
    of the bytes. A weight its values do not give back bit-exactly stays float. ``copies``: the
    int8 copies made so far, by float module (the partitions' reference forms share them). Call it
    once ``gm`` is lowered."""
    snapshot = snapshot_of(gm)
    if snapshot is None:
        return
    swapped = hold_as_int8(snapshot.held, copies, keep_float={id(module) for module in gm.modules()})
    gm.meta[SNAPSHOT] = dataclasses.replace(snapshot, int8_weights={**snapshot.int8_weights, **swapped})


def hold_weight_as_int8(gm: fx.GraphModule, path: str, copies: Copies) -> None:
    """:func:`hold_weights_as_int8` for the one module at ``path``, which a kernel just replaced
    in ``gm`` (kept float while ``gm`` still runs it elsewhere, a module shared by two paths)."""
    snapshot = snapshot_of(gm)
    if snapshot is None:
        return
    module = snapshot.held.get_submodule(path)
    if any(running is module for running in gm.modules()):
        return
    held = hold_module_as_int8(snapshot.held, path, copies)
    if held is not None:
        gm.meta[SNAPSHOT] = dataclasses.replace(snapshot, int8_weights={**snapshot.int8_weights, path: held})
