"""Observers for prepare: one built per qconfig factory, the rest copied from it.

A model of 5,600 nodes needs 2,400 activation observers, nearly all from the same factory.
Building each runs the observer's ``__init__`` (argument checks, ``register_buffer`` calls:
~80 us), copying a built one field by field takes ~20 us (:func:`qplug_core.nn.copying.copy_fields`)
and gives the same module: qplug's observers hold only their arguments and fresh statistic
buffers after ``__init__``. Only :class:`~qplug_core.observers.factory.ObserverFactory` values
(a class plus keyword arguments, no code of their own) whose observer copies field by field
are copied; any other callable, and any observer with submodules or state of other kinds,
is built by calling it, each time, as before.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from qplug_core.nn.copying import copy_fields, field_copyable
from qplug_core.observers.factory import ObserverFactory

__all__ = ["ObserverCopies"]


class ObserverCopies:
    """``copies(factory)`` is a new observer, equal to ``factory()`` (see the module docstring)."""

    def __init__(self) -> None:
        # id(factory) -> (factory kept alive so that its id stays its own, prototype or None)
        self._prototypes: dict[int, tuple[Any, nn.Module | None]] = {}

    def __call__(self, factory: Callable[[], nn.Module]) -> nn.Module:
        if not isinstance(factory, ObserverFactory):
            return factory()
        entry = self._prototypes.get(id(factory))
        if entry is None:
            built = factory()
            prototype = built if field_copyable(built) else None
            self._prototypes[id(factory)] = (factory, prototype)
            if prototype is None:
                return built
        else:
            prototype = entry[1]
        return factory() if prototype is None else copy_fields(prototype)
