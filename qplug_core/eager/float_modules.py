"""Float modules left in a converted eager model say so when an int8 tensor reaches them.

Eager mode cannot see which tensors reach a module, so a float layer between the stubs (one with
no int8 kernel on the backend, as ``nn.LSTM``, or whose qconfig is None without a DeQuantStub
before it) received int8 tensors and torch raised at the first call ("Could not run
'aten::zero_' with arguments from the 'QuantizedCPU' backend"). A pre-hook on each such layer
turns that into a :class:`ModelStateError` naming the layer and the fix; it costs one
``is_quantized`` test per tensor argument.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from qplug_core.errors import ModelStateError

_NAME = "_qplug_float_module_name"


def guard_float_modules(model: nn.Module, backend_name: str) -> None:
    """A pre-hook on every torch float layer with weights left in converted ``model``."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith("torch.nn.modules.") and any(
                p.is_floating_point() for p in module.parameters(recurse=False)):
            module.__dict__[_NAME] = (name, backend_name)
            module.register_forward_pre_hook(_refuse_int8_input)


def _refuse_int8_input(module: nn.Module, args: tuple[Any, ...]) -> None:
    if not any(getattr(arg, "is_quantized", False) for arg in args):
        return
    name, backend = module.__dict__[_NAME]
    raise ModelStateError(
        f"module {name!r} ({type(module).__name__}) stayed float after qp.eager.convert (backend {backend!r} "
        "has no static int8 kernel for it, or its qconfig is None), but an int8 tensor reaches it: put a "
        "DeQuantStub before it (and a QuantStub after it where int8 goes on)"
        + (", or quantize it with qp.quantize_dynamic" if isinstance(module, nn.RNNBase) else ""))
