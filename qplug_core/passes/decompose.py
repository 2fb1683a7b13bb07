"""One-to-many rewrite: replace an op by the ops a Python function computes with.

A decomposition is called with ``torch.fx.Proxy`` arguments, so whatever it computes is recorded
into the new graph (``x * (x > 0)`` records ``operator`` nodes; call ``torch.ops.aten.*``
overloads explicitly to stay at ATen level).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from torch.fx import GraphModule

from qplug_core.errors import PassError
from qplug_core.passes.transformer import MetaTransformer, TransformerPass

__all__ = ["DecomposePass"]


class _Decompose(MetaTransformer):
    def __init__(self, module: GraphModule,
                 decompositions: Mapping[Callable[..., Any], Callable[..., Any]]):
        super().__init__(module)
        self.decompositions = decompositions

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        fn = self.decompositions.get(target)
        if fn is None:
            return super().call_function(target, args, kwargs)
        self.changed = True
        return fn(*args, **kwargs)


class DecomposePass(TransformerPass):
    """Decompose ``call_function`` nodes: ``{torch.relu: lambda x: x * (x > 0)}``."""

    def __init__(self, decompositions: Mapping[Callable[..., Any], Callable[..., Any]]) -> None:
        bad = [k for k, v in decompositions.items() if not callable(v)]
        if bad:
            raise PassError(f"DecomposePass decompositions must be callables; bad entries for "
                            f"{bad!r}", pass_name="DecomposePass")
        self.decompositions = dict(decompositions)

    def make_transformer(self, graph_module: GraphModule) -> MetaTransformer:
        return _Decompose(graph_module, self.decompositions)
