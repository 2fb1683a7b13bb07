"""The reference form of a converted model, kept as it was before lowering.

``qp.save`` writes the reference form (lowered kernels hold packed, engine-specific weights no
file can carry), and exporters and compilers start from it. Convert keeps it here as a
:class:`ReferenceSnapshot`, a second GraphModule over the same submodules (nothing is copied but
the graph): lowering swaps submodules of the converted model for kernels and never changes a
reference module, so the snapshot stays the reference form. Encoding it is serialization's job,
done only when the model is saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import fx

from qplug_core.flows.tags import SNAPSHOT
from qplug_core.ir.copying import deepcopy_graph
from qplug_core.kernels.arithmetic import pair_sums_saturate

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
    accuracy target took out of static int8 runs (:mod:`qplug_core.flows.target_rungs`)."""

    graph_module: fx.GraphModule
    backend: str
    plugins: tuple[dict[str, str | None], ...]
    per_token_layers: tuple[str, ...] = ()
    int16_pairs: bool = False
    target_rungs: dict[str, str] = field(default_factory=dict)


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
