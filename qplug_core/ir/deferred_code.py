"""A GraphModule whose Python is generated when first needed, not when it is built.

``GraphModule(root, graph)`` generates and compiles ``forward`` from the graph straight away
(~0.25 s at 5,600 nodes). The flows rewrite a freshly captured graph before anything runs it and
recompile once after their passes, so that first code is thrown away unread. torch's own
``_LazyGraphModule`` defers it too, but stays lazy for every later ``recompile`` as well (the
prepared model would then compile at its first calibration batch, and it is a private class);
here only the code of the captured graph is deferred: the module is an ordinary GraphModule,
and the first call, ``.code``, ``str()`` or ``recompile()`` generates it from the graph as it
is then.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.fx import Graph, GraphModule

__all__ = ["graph_module_without_code"]


def graph_module_without_code(root: nn.Module, graph: Graph, class_name: str) -> GraphModule:
    """``GraphModule(root, graph, class_name)`` without generating ``forward`` yet.

    Each GraphModule has a class of its own (``GraphModule.__new__``), so the hooks that generate
    the code on first use are set on that class only, and a real ``recompile`` replaces them."""
    gm = GraphModule.__new__(GraphModule)
    own_class = type(gm)
    own_class.recompile = _no_code  # type: ignore[method-assign]  # the graph setter calls it
    try:
        GraphModule.__init__(gm, root, graph, class_name)
    finally:
        del own_class.recompile
    own_class.forward = _forward_after_codegen  # type: ignore[method-assign]
    own_class.code = property(_code_after_codegen)  # type: ignore[method-assign, assignment]
    own_class.__str__ = _str_after_codegen  # type: ignore[method-assign]
    return gm


def _no_code(self: GraphModule) -> None:
    return None


def _ensure_code(gm: GraphModule) -> None:
    if "_code" not in gm.__dict__:
        gm.recompile()  # sets the class's real forward


def _forward_after_codegen(self: GraphModule, *args: Any, **kwargs: Any) -> Any:
    _ensure_code(self)
    return self(*args, **kwargs)


def _code_after_codegen(self: GraphModule) -> str:
    _ensure_code(self)
    return self.__dict__["_code"]


def _str_after_codegen(self: GraphModule) -> str:
    _ensure_code(self)
    return GraphModule.__str__(self)
