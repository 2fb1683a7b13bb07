"""Deep copies of captured graphs without torch's own deprecation noise.

The code generator of a graph captured by ``torch.export`` holds pytree ``LeafSpec``s, which torch
rebuilds on copy through its own deprecated path: the ``FutureWarning`` it gives ("isinstance(treespec,
LeafSpec) is deprecated", from copyreg) is torch's, nothing a user can change, and it reached every
user of an exported model whose graph qplug copies (auto, compare, export_onnx, convert_fx).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import TypeVar

__all__ = ["deepcopy_graph", "quiet_graph_copies"]

T = TypeVar("T")


@contextlib.contextmanager
def quiet_graph_copies() -> Iterator[None]:
    """Leave out torch's ``LeafSpec`` FutureWarning (only that one) while graphs are copied inside."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield


def deepcopy_graph(graph: T) -> T:
    """``copy.deepcopy`` of a Graph, a GraphModule or a model holding one, quietly (see above)."""
    with quiet_graph_copies():
        return copy.deepcopy(graph)
