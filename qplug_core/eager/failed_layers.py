"""An eager-converted model's int8 layer whose call fails says which layer it is.

Eager convert puts the backend's kernels (plugin classes) into the user's own model, so a failing
call met the kernel's words (qplug's "int8 Conv2d takes inputs with 3 channels", torch's "Quantize
only works on Float Tensor, got Double") naming no layer, where the module-swapped layers
(:class:`~qplug_core.kernels.layer_faults.ExplainedLayer`) name theirs. A wrapper on every swapped
layer cost a small batch-1 CNN ~0.5 us per layer per call (``bench/bench_eager_call_overhead.py``)
and nothing needs to run while calls succeed, so the model's own call catches the error
(:mod:`qplug_core.eager.root_call`) and :func:`named_error` reads its traceback: the ``nn.Module``
call frames say which swapped layer was being called and with what. A refusal by qplug's kernel,
or a float input of another dtype than float32 (what quantizing takes, as the float layer after the
stub takes only its weight's dtype), is raised as :class:`~qplug_core.errors.InputMismatchError`
naming the layer (:func:`~qplug_core.kernels.layer_faults.explained_error`); any other error is
raised as it was. A swapped layer called on its own, not through the model, does not name itself.
"""

from __future__ import annotations

import torch
from torch import nn

from qplug_core.ir.failed_calls import failed_module_calls
from qplug_core.kernels.layer_faults import ExplainedLayer, Fault, explained_error, wrong_dtype

__all__ = ["named_error"]


def named_error(model: nn.Module, names: frozenset[str], error: Exception) -> Exception | None:
    """``error`` of a call of ``model`` naming the module among ``names`` (its swapped ones) whose call
    raised it, or None to raise it as it is."""
    layers = {id(m): (n, m) for n, m in model.named_modules() if n in names and not isinstance(m, ExplainedLayer)}
    for called, args in failed_module_calls(error):
        if id(called) in layers:
            name, module = layers[id(called)]
            return explained_error(module, name, error, lambda: _float_input_fault(args))
    return None


def _float_input_fault(args: tuple) -> Fault | None:
    """A float (not quantized) first input that is not float32: quantizing takes float32 only."""
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and not x.is_quantized:
        return wrong_dtype(x, torch.float32)
    return None
