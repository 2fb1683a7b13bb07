"""The pass contract: what a pass returns and the hooks it may implement.

Kept tiny on purpose so that plugins can write passes without pulling in the manager.
"""

from __future__ import annotations

import abc
from typing import NamedTuple

from torch.fx import GraphModule

__all__ = ["PassResult", "PassBase"]


class PassResult(NamedTuple):
    """What a pass produced: the (possibly new) GraphModule and whether it changed anything.

    ``modified`` drives the PassManager's fixpoint loop, so report False when nothing changed.
    """

    graph_module: GraphModule
    modified: bool


class PassBase(abc.ABC):
    """A graph pass with optional pre/post-conditions.

    ``__call__`` runs ``requires``, ``call`` and ``ensures`` so that invariants are checked in one
    place instead of inside every pass body.
    """

    @property
    def name(self) -> str:
        """The name used in errors and logs (the class name unless overridden)."""
        return type(self).__name__

    def __call__(self, graph_module: GraphModule) -> PassResult:
        self.requires(graph_module)
        result = self.call(graph_module)
        self.ensures(result.graph_module if isinstance(result, PassResult) else graph_module)
        return result

    @abc.abstractmethod
    def call(self, graph_module: GraphModule) -> PassResult:
        """Transform ``graph_module`` and return a :class:`PassResult`."""

    def requires(self, graph_module: GraphModule) -> None:  # noqa: B027 - optional hook
        """Raise if ``graph_module`` does not meet this pass's preconditions."""

    def ensures(self, graph_module: GraphModule) -> None:  # noqa: B027 - optional hook
        """Raise if the result does not meet this pass's postconditions."""
