"""Upsampling and pooling modules left running on int8 tensors get a dense batch stride where they need it.

torch's int8 kernels of these modules misread a batch-1 tensor whose batch stride is not a dense
one's (tokens transposed and reshaped into a map: SegFormer's decoder), so graph mode's lowering
passes their input through ``dense_batch_stride`` and eager convert puts a pre-hook doing the
same on each such module (:func:`restride`). A pre-hook takes torch's hooked call path, ~2 us per
call (``bench/bench_eager_call_overhead.py``), as much as a small pooling kernel, while most of
these modules get a conv's output, dense at every batch size. So after the kernel check
:func:`keep_needed_restrides` runs the int8 model on one row of the prepared model's recorded first
call and keeps the hook on the modules that got a batch-1 int8 tensor it changes there, or that
the row did not reach (a branch not taken), or on all of them if the run fails or there is no
recorded call. A tensor's strides follow the ops that made it, not its values, so later batch-1
calls get what the row got (at larger batches the restride changes nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from qplug_core.eager.kernel_check import run_one_row
from qplug_core.ir.hooks import drop_pre_hooks
from qplug_core.kernels.passthrough import dense_batch_stride

__all__ = ["keep_needed_restrides", "restride"]


def _dense_batch_stride_input(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook: the module's int8 input through ``dense_batch_stride``."""
    if args and getattr(args[0], "is_quantized", False):
        return (dense_batch_stride(args[0]), *args[1:])
    return None


def restride(module: nn.Module) -> None:
    """Give ``module`` (upsampling or pooling, on int8 tensors) its input with a dense batch stride."""
    module.register_forward_pre_hook(_dense_batch_stride_input)


def keep_needed_restrides(model: nn.Module, modules: list[nn.Module], example: tuple[tuple, dict] | None,
                          engine: str | None) -> None:
    """Take the :func:`restride` hook off those of ``modules`` (in converted ``model``) that got only
    dense batch strides on one row of ``example``."""
    if not modules or example is None:
        return
    needed: set[int] = set()
    dense: set[int] = set()

    def note(module: nn.Module, args: tuple) -> tuple | None:
        x = args[0] if args else None
        unsure = isinstance(x, torch.Tensor) and x.is_quantized and x.dim() >= 4 and (
            x.size(0) != 1 or dense_batch_stride(x) is not x)  # not batch 1 here, or restrided
        (needed if unsure else dense).add(id(module))
        return _dense_batch_stride_input(module, args)

    with _in_place_of_restride(modules, note):
        try:
            run_one_row(model, example, engine)
        except Exception:  # noqa: BLE001 - the hooks stay: the user's first call will say what is wrong
            return
    for module in modules:
        if id(module) in dense and id(module) not in needed:
            drop_pre_hooks(module, lambda hook: hook is _dense_batch_stride_input)


@contextlib.contextmanager
def _in_place_of_restride(modules: list[nn.Module], hook: Callable[[nn.Module, tuple], tuple | None]
                          ) -> Iterator[None]:
    """``hook`` called where each module's restride hook is (after the user's pre-hooks)."""
    entries = [(m._forward_pre_hooks, key) for m in modules
               for key, h in m._forward_pre_hooks.items() if h is _dense_batch_stride_input]
    for hooks, key in entries:
        hooks[key] = hook
    try:
        yield
    finally:
        for hooks, key in entries:
            hooks[key] = _dense_batch_stride_input
