"""Deep copies of captured graphs without torch's own deprecation noise.

The code generator of a graph captured by ``torch.export`` holds pytree ``LeafSpec``s, which torch
rebuilds on copy through its own deprecated path: the ``FutureWarning`` it gives ("isinstance(treespec,
LeafSpec) is deprecated", from copyreg) is torch's, nothing a user can change, and it reached every
user of an exported model whose graph qplug copies (auto, compare, export_onnx, convert_fx).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = ["deepcopy_graph", "deepcopy_sharing"]

T = TypeVar("T")


def deepcopy_graph(graph: T, memo: dict[int, Any] | None = None) -> T:
    """``copy.deepcopy`` of a Graph, a GraphModule or a model holding one, without torch's
    ``LeafSpec`` FutureWarning (only that one; see above); ``memo`` as deepcopy's (objects to put
    in the copy in place of some, by ``id``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        return copy.deepcopy(graph, memo)


def deepcopy_sharing(graph: T, tensors: Iterable[Any]) -> T:
    """:func:`deepcopy_graph` whose copy holds ``tensors`` themselves, not copies of them: for a copy
    whose flow only reads them (a model's float weights are most of its bytes)."""
    return deepcopy_graph(graph, {id(tensor): tensor for tensor in tensors})
