"""One-to-none rewrite: drop ops that return their input unchanged at inference time.

Removed: ``detach`` (function, method and ``aten.detach``/``aten.alias``), ``nn.Identity``
modules, ``nn.Dropout*`` modules in eval mode, and ``F.dropout`` / ``aten.dropout`` calls whose
``training`` argument is literally False. ``contiguous`` is kept: it changes memory layout,
which kernels downstream may rely on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

from qplug_core.passes.transformer import MetaTransformer, TransformerPass

__all__ = ["RemoveNoOpsPass"]

_IDENTITY_FUNCTIONS = frozenset({
    torch.detach, torch.Tensor.detach, torch.ops.aten.detach.default, torch.ops.aten.alias.default,
})
_IDENTITY_METHODS = frozenset({"detach"})
_DROPOUT_FUNCTIONS = {
    # target -> (position, name) of its ``training`` argument
    F.dropout: (2, "training"), F.dropout1d: (2, "training"), F.dropout2d: (2, "training"),
    F.dropout3d: (2, "training"), F.alpha_dropout: (2, "training"),
    torch.dropout: (2, "train"), torch.ops.aten.dropout.default: (2, "train"),
}
DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                    nn.FeatureAlphaDropout)


def _training_is_false(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    pos, name = _DROPOUT_FUNCTIONS[target]
    value = args[pos] if len(args) > pos else kwargs.get(name, True)
    return value is False


class _RemoveNoOps(MetaTransformer):
    def _skip(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.changed = True
        return args[0] if args else kwargs.get("input", kwargs.get("self"))

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target in _IDENTITY_FUNCTIONS or (target in _DROPOUT_FUNCTIONS
                                             and _training_is_false(target, args, kwargs)):
            return self._skip(args, kwargs)
        return super().call_function(target, args, kwargs)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target in _IDENTITY_METHODS:
            return self._skip(args, kwargs)
        return super().call_method(target, args, kwargs)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.fetch_attr(target)
        if isinstance(module, nn.Identity) or (isinstance(module, DROPOUT_MODULES)
                                               and not module.training):
            return self._skip(args, kwargs)
        return super().call_module(target, args, kwargs)


class RemoveNoOpsPass(TransformerPass):
    """Remove detach, identity and eval-mode dropout nodes; their users read the input instead."""

    def make_transformer(self, graph_module: GraphModule) -> MetaTransformer:
        return _RemoveNoOps(graph_module)
