"""The reference-form partition a compiled (or to-be-compiled) partition keeps, as it is held.

Kept outside the module tree (it is no part of the model's state) and, once the pipeline has
made it smaller (weights as int8 values: ``kernels/held_int8.py``), as a :class:`HeldForm`,
read back as a GraphModule of its own at each read.
"""

from __future__ import annotations

from typing import Protocol

from torch import fx


class HeldForm(Protocol):
    """A reference form held otherwise than as a GraphModule, read back as one."""

    @property
    def graph_module(self) -> fx.GraphModule:
        """The reference form, a GraphModule of its own."""


class HoldsPartition:
    """``partition``, ``form`` and ``hold`` over ``self.__dict__["_partition"]``."""

    @property
    def partition(self) -> fx.GraphModule:
        """The reference-form partition (built again from its held form at each read, where it is
        held as one: :meth:`hold`)."""
        form = self.__dict__["_partition"]
        return form if isinstance(form, fx.GraphModule) else form.graph_module

    @property
    def form(self) -> fx.GraphModule | HeldForm:
        """The reference-form partition as held."""
        return self.__dict__["_partition"]

    def hold(self, form: fx.GraphModule | HeldForm) -> None:
        """Hold the reference form as ``form`` (the same partition held in fewer bytes)."""
        self.__dict__["_partition"] = form
