"""What a converted model holds: every real tensor reachable from it, by storage (for tests and
benches of a backend: its compiled partitions should hold no float copy of a weight).

Walks modules, their attributes (a compiled partition's reference form is one, kept outside the
module tree), ``GraphModule.meta`` (the reference snapshot, the partition forms) and the
containers and dataclasses in between; a storage reached twice counts once. Graph nodes and
their meta are skipped (shape metadata, fake tensors), as are opaque runtime objects (an ORT
session, an OpenVINO compiled model), which hold what they hold out of Python's sight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from torch import fx

__all__ = ["float_weight_copies", "reachable_tensors"]


def reachable_tensors(root: object) -> Iterator[torch.Tensor]:
    """Each real tensor reachable from ``root``, once per storage."""
    seen_objects: set[int] = set()
    seen_storages: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or isinstance(obj, (fx.Graph, fx.Node, str, bytes, int, float, type)):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta" or type(obj).__name__ == "FakeTensor":
                continue
            storage = obj.untyped_storage().data_ptr()
            if storage not in seen_storages:
                seen_storages.add(storage)
                yield obj
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, torch.nn.Module) or dataclasses.is_dataclass(obj):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("qplug", "torch")):
            stack.extend(vars(obj).values())


def float_weight_copies(root: object, shapes: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The float tensors reachable from ``root`` whose shape is one of ``shapes`` (a layer's
    weight), sorted: a model holding its weights as int8 holds none."""
    return sorted(tuple(t.shape) for t in reachable_tensors(root)
                  if t.is_floating_point() and tuple(t.shape) in shapes)
