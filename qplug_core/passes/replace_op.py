"""One-to-one rewrite: call every mapped target as another target with the same arguments."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from torch.fx import GraphModule

from qplug_core.errors import PassError
from qplug_core.passes.transformer import MetaTransformer, TransformerPass

__all__ = ["ReplaceOpPass"]


class _ReplaceOp(MetaTransformer):
    def __init__(self, module: GraphModule, mapping: Mapping[Callable[..., Any], Callable[..., Any]]):
        super().__init__(module)
        self.mapping = mapping

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        new_target = self.mapping.get(target)
        if new_target is None:
            return super().call_function(target, args, kwargs)
        self.changed = True
        return super().call_function(new_target, args, kwargs)


class ReplaceOpPass(TransformerPass):
    """Replace ``call_function`` targets, e.g. ``{torch.ops.aten.add.Tensor: torch.ops.aten.mul.Tensor}``.

    Works at both levels as long as the keys are the targets found at that level (``operator.add``
    / ``torch.add`` after symbolic tracing, ``torch.ops.aten.*`` after export).
    """

    def __init__(self, mapping: Mapping[Callable[..., Any], Callable[..., Any]]) -> None:
        bad = [k for k, v in mapping.items() if not (callable(k) and callable(v))]
        if bad:
            raise PassError(f"ReplaceOpPass mapping must map callables to callables; bad keys: "
                            f"{bad!r}", pass_name="ReplaceOpPass")
        self.mapping = dict(mapping)

    def make_transformer(self, graph_module: GraphModule) -> MetaTransformer:
        return _ReplaceOp(graph_module, self.mapping)
