"""The float side of layers made from functional calls (``F.conv2d(x, self.w)``, ``x @ self.w``).

Such a layer is a module only in the quantized model (``conv2d_module``, see
:mod:`qplug_core.flows.normalize`); the float model runs a function, which no forward hook sees.
Normalize recorded the float weight each one was given, so while the float model runs, a torch
function mode copies the output of every conv/linear/matmul call whose weight *is* that parameter, under
the quantized layer's name.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from qplug_core.analysis.followers import Followers
from qplug_core.flows.normalize import functional_weights

#: the calls a quantized layer can be made from -> the position of their weight argument
#: (normalize takes linear and conv; an exported graph also ``x @ w`` and ``addmm(b, x, w)``)
_WEIGHT_ARGUMENT = {**dict.fromkeys((F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d,
                                     F.conv_transpose2d, F.conv_transpose3d, torch.matmul, torch.mm,
                                     torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm), 1),
                    torch.addmm: 2}


def functional_layers(float_model: nn.Module, quantized_model: nn.Module
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(layer -> float weight, layer -> why it cannot be paired)`` for the quantized model's
    layers made from functional calls (a layer of the same name in the float model is compared as
    a module already)."""
    float_names = {n for n, _ in float_model.named_modules()}
    quant_names = {n for n, _ in quantized_model.named_modules()}
    recorded = {layer: path for layer, path in functional_weights(quantized_model).items()
                if layer in quant_names and layer not in float_names}
    uses = Counter(recorded.values())
    weights, skipped = {}, {}
    for layer, path in recorded.items():
        weight = _tensor_at(float_model, path)
        if weight is None:
            skipped[layer] = (f"made from a functional call on weight {path!r}, which the float "
                              "model does not have")
        elif uses[path] > 1:
            skipped[layer] = (f"made from one of {uses[path]} functional calls on weight {path!r}; "
                              "a weight called once is needed to tell them apart")
        else:
            weights[layer] = weight
    return weights, skipped


def never_called(layer: str, quantized_model: nn.Module) -> str:
    """Why ``layer`` has no float output: no call of the float model took its weight."""
    weight = functional_weights(quantized_model).get(layer)
    return (f"made from a functional call on weight {weight!r}, but no linear/conv/matmul call of the "
            "float model that compare sees took that weight as it is (a slice or a view of it is another "
            "tensor; the calls inside a torch function such as F.multi_head_attention_forward are not seen)")


def _tensor_at(model: nn.Module, path: str) -> torch.Tensor | None:
    """The parameter or buffer at ``path`` in ``model``, else None."""
    for lookup in (model.get_parameter, model.get_buffer):
        try:
            return lookup(path)
        except AttributeError:
            continue
    return None


class FunctionalRecorder(TorchFunctionMode):
    """Copies the output of each conv/linear/matmul call on one of ``weights`` (layer -> float weight),
    call by call, the ops after it that the int8 layer computes (``followers``) applied: what
    ``_Recorder`` does for modules."""

    def __init__(self, weights: Mapping[str, torch.Tensor], followers: Mapping[str, Followers],
                 outputs: dict[str, list[torch.Tensor]]) -> None:
        super().__init__()
        self._layers = [(weight, layer, followers.get(layer)) for layer, weight in weights.items()]
        #: shared with the module recorder, so that the rows keep the float model's call order
        self.outputs = outputs
        self.functions: dict[str, str] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        position = _WEIGHT_ARGUMENT.get(func)
        if position is not None and self._layers:
            weight = args[position] if len(args) > position else kwargs.get("weight")
            for tensor, layer, after in self._layers:
                if weight is tensor:
                    snapshot = output.detach().clone()
                    self.outputs.setdefault(layer, []).append(snapshot if after is None else after.apply(snapshot))
                    self.functions[layer] = _printed(func)
        return output


def _printed(func: Any) -> str:
    """The call as the float model's code writes it: ``F.conv2d``, ``torch.addmm``, ``Tensor.matmul``."""
    name = func.__name__
    for prefix, namespace in (("F", F), ("torch", torch)):
        if getattr(namespace, name, None) is func:
            return f"{prefix}.{name}"
    return "@" if name == "__matmul__" else f"Tensor.{name}"
