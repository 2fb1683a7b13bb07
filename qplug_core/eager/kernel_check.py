"""Eager convert checks its kernels as graph mode does (:mod:`qplug_core.flows.kernel_check`).

Eager mode has no graph and no example inputs, so prepare records the first call of the prepared
model (:func:`record_example`: one row of each batched tensor unless it is small, so memory stays
bounded), and convert, after swapping, runs the int8 model on it and:

* holds each module's kernel to the kernel contract, on the int8 input it got there (one run
  keeps every module's input and output), against its reference computation (dequantize -> float
  module with int8 weights -> quantize to the module's output qparams); a kernel that breaks it is
  replaced by that computation, with a warning naming the module, the engine and how far off it was;
* compares the int8 model's outputs with its reference form's (each swapped module replaced by
  its reference computation) within a multi-region partition's drift (graph mode's delegate
  check). What eager mode cannot see as a module shows only here: an ``F.relu6`` called in
  ``forward`` runs torch 2.13's qnnpack clamp, wrong on channels_last int8 tensors. A model off
  by more gets a warning with its SQNR against the reference form.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from qplug_core.errors import QplugError, first_line, warn_user
from qplug_core.flows.delegate import MAX_RELATIVE_L2
from qplug_core.flows.kernel_check import (
    CONTRACT_BROKEN,
    as_float,
    laid_out_copy,
    output_violation,
    tensors_in,
)
from qplug_core.flows.tags import EAGER_EXAMPLE
from qplug_core.ir.hooks import copy_forward_hooks, drop_pre_hooks
from qplug_core.kernels.base import engine_context
from qplug_core.kernels.passthrough import unsupported_passthrough_ops
from qplug_core.qparams import QParams

#: the first call is kept whole up to this many bytes of tensors ...
EXAMPLE_BYTES = 1 << 20
#: ... else this many rows (first dimension) of each batched tensor: the check costs about one int8
#: and two reference-form forward passes of them
EXAMPLE_ROWS = 1


@dataclass
class Swap:
    """A module convert replaced (qualified name): its int8 module, its reference computation (what
    the reference backend gives: float values on the int8 grid) and, for a kernel to check, the
    output qparams the kernel quantizes to."""

    name: str
    int8: nn.Module
    reference: nn.Module
    output_qparams: QParams | None = None


def _rows(value: Any, batch: int | None) -> Any:
    def keep(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        v = v.detach()
        return (v[:EXAMPLE_ROWS] if v.dim() and v.shape[0] == batch else v).clone()
    return tree_map(keep, value)  # the call's own containers (a model may write into its dict input)


def _batch(tensors: list[torch.Tensor]) -> int | None:
    """The batch size of a call's ``tensors``: the first dimension of the first one with dimensions."""
    first = next((t for t in tensors if t.dim()), None)
    return None if first is None else first.shape[0]


def _record_first_call(model: nn.Module, args: tuple, kwargs: dict) -> None:
    if EAGER_EXAMPLE in model.__dict__:
        return
    tensors = tensors_in((args, kwargs))
    small = sum(t.numel() * t.element_size() for t in tensors) <= EXAMPLE_BYTES
    batch = None if small else _batch(tensors)
    model.__dict__[EAGER_EXAMPLE] = (_rows(args, batch), _rows(kwargs, batch))


def record_example(model: nn.Module) -> None:
    """Keep the first call of prepared ``model`` for convert's check (one dict lookup per call)."""
    model.register_forward_pre_hook(_record_first_call, with_kwargs=True)


def recorded_example(model: nn.Module) -> tuple[tuple, dict] | None:
    """The recorded first call of ``model`` (None if it never ran), taken off it with its hook."""
    drop_pre_hooks(model, lambda hook: hook is _record_first_call)
    return model.__dict__.pop(EAGER_EXAMPLE, None)


def _kernel_calls(model: nn.Module, swaps: list[Swap], example: tuple[tuple, dict]
                  ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], Any]:
    """Each checked module's first (input, output) in one run of ``model`` on ``example`` (copies
    laid out as the originals, as graph mode's check keeps them: a later in-place op must not
    change them; the output as the module returned it, before the user's forward hooks), and the
    model's output."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keeper(name: str) -> Callable[[nn.Module, tuple, Any], None]:
        def keep(module: nn.Module, args: tuple, output: Any) -> None:
            if name not in seen and args and isinstance(args[0], torch.Tensor) \
                    and isinstance(output, torch.Tensor):
                seen[name] = laid_out_copy(args[0]), laid_out_copy(output)
        return keep

    handles = [s.int8.register_forward_hook(keeper(s.name), prepend=True) for s in swaps]
    try:
        output = model(*example[0], **example[1])
    finally:
        for handle in handles:
            handle.remove()
    return seen, output


def _with_hooks_of(source: nn.Module, module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` calling ``source``'s forward hooks (the user's, from convert)."""
    if module is source:
        return module
    twin = copy.copy(module)
    copy_forward_hooks(source, twin)
    return twin


def _reference_form(model: nn.Module, swaps: list[Swap]) -> nn.Module:
    """``model`` with each swapped module replaced by its reference computation (weights shared)."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for swap in swaps:
        current = model.get_submodule(swap.name)
        memo[id(current)] = _with_hooks_of(current, swap.reference)
    return copy.deepcopy(model, memo)


def _drift(out: Any, reference: Any) -> str:
    """Why the int8 model's outputs ``out`` are off its reference form's ('' if within a deep
    partition's drift), with their SQNR against them in dB."""
    got, want = tensors_in(out), tensors_in(reference)
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        return "its outputs differ in number or shape from its reference form's"
    floats = [(as_float(g).double().flatten(), as_float(w).double().flatten()) for g, w in zip(got, want)
              if w.is_quantized or w.is_floating_point()]  # not an argmax: one flip is no drift
    if not floats:
        return ""
    actual, expected = torch.cat([g for g, _ in floats]), torch.cat([w for _, w in floats])
    noise, signal = float((actual - expected).norm()), float(expected.norm())
    if noise == 0:
        return ""
    relative = noise / signal if signal else math.inf
    sqnr = -20 * math.log10(relative) if signal else -math.inf
    cosine = float(torch.nn.functional.cosine_similarity(actual, expected, dim=0)) if signal else 0.0
    if not cosine > 0 or relative > MAX_RELATIVE_L2:
        return (f"its outputs are {sqnr:.1f} dB SQNR from its reference form's (error {relative:.0%} of "
                f"their L2 norm, at most {MAX_RELATIVE_L2:.0%})")
    return ""


def _raised(model: nn.Module, swaps: list[Swap], example: tuple[tuple, dict], error: Exception) -> str:
    """What the int8 model raising ``error`` on ``example`` says: the int8 model is broken, or the
    example (rows of the first call) is not an input the model takes (its reference form raises too)."""
    what = f"{type(error).__name__}: " + (str(error) if isinstance(error, QplugError) else first_line(error)[:160])
    try:
        _reference_form(model, swaps)(*example[0], **example[1])
    except Exception:  # noqa: BLE001 - any failure says the example does not fit the model
        return (f"the prepared model's first call, as kept for the check (one row of each batched tensor "
                f"beyond {EXAMPLE_BYTES >> 20} MiB), does not run through its reference form either ({what})")
    return f"the int8 model raised on the prepared model's first call, which its reference form runs ({what})"


#: what eager convert cannot do for F.interpolate and the pooling functions called in ``forward()``
_BATCH_STRIDE_HINT = (". F.interpolate and the 2-d/3-d pooling functions called in forward() misread a batch-1 "
                      "view of transposed tokens reshaped into a map on int8 tensors: use the modules "
                      "(nn.Upsample, nn.MaxPool2d, nn.AdaptiveAvgPool2d, ...), whose input convert gives a dense "
                      "batch stride, or graph mode (qp.quantize)")


def _unseen_ops_hint(engine: str | None) -> str:
    ops = [op for op in unsupported_passthrough_ops(engine) if not isinstance(op, type)] if engine else []
    if not ops:
        return _BATCH_STRIDE_HINT
    names = ", ".join(dict.fromkeys(getattr(op, "__name__", str(op)) for op in ops))  # torch.clamp and "clamp"
    return (f". On {engine!r}, torch gets these wrong on int8 tensors, or lacks them: {names}; called in "
            "forward() they run on int8 tensors unseen by eager convert (F.relu6 / F.hardtanh / torch.clamp "
            "are wrong on channels_last ones): use the modules (nn.ReLU6, nn.Hardtanh), which convert runs "
            f"on dequantized values, or graph mode (qp.quantize){_BATCH_STRIDE_HINT}")


@contextlib.contextmanager
def _buffers_kept(model: nn.Module) -> Iterator[Callable[[], None]]:
    """Gives a function that puts the model's buffers back as they were here, called before each of
    the check's runs and after them: a stateful model's frame counter or cache sees each run start
    from the same state, and leaves convert as calibration left it (state in plain attributes is
    the model's own)."""
    saved = [(module, name, buffer, buffer.clone()) for module in model.modules()
             for name, buffer in module._buffers.items() if buffer is not None and not buffer.is_quantized]

    def restore() -> None:
        for module, name, buffer, values in saved:
            module._buffers[name] = buffer  # the same tensor (kernels may hold it), its values back
            buffer.copy_(values)
    try:
        yield restore
    finally:
        restore()


def run_one_row(model: nn.Module, example: tuple[tuple, dict], engine: str | None) -> None:
    """Run converted ``model`` on one row of each batched tensor of ``example`` (the recorded first
    call) as the check runs it: without grad, under ``engine``, its buffers put back after."""
    batch = _batch(tensors_in(example))
    with torch.no_grad(), engine_context(engine), _buffers_kept(model):
        model(*_rows(example[0], batch), **_rows(example[1], batch))


def check_kernels(model: nn.Module, swaps: list[Swap], example: tuple[tuple, dict] | None,
                  backend: Any, in_reference_form: Callable[[nn.Module, QParams], nn.Module]) -> None:
    """Check converted ``model`` on ``example`` (see the module docstring); a module whose kernel
    breaks the contract becomes ``in_reference_form(swap)`` in ``model``."""
    label = f"qplug: backend {backend.name!r} (engine {backend.engine!r})"
    if example is None:
        warn_user(f"{label}: the int8 kernels were not checked against their reference form: the prepared "
                  "model never ran (its observers were loaded); run one batch through it before convert")
        return
    checked = [s for s in swaps if s.output_qparams is not None]
    with torch.no_grad(), engine_context(backend.engine), _buffers_kept(model) as restore:
        try:
            calls, output = _kernel_calls(model, checked, example)
        except Exception as error:  # noqa: BLE001 - the user's first call will say it again
            warn_user(f"{label}: {_raised(model, swaps, example, error)}; its kernels went in unchecked")
            return
        replaced = 0
        for swap in checked:
            qparams = swap.output_qparams
            if qparams is None or swap.name not in calls:
                continue  # not run on the example (a branch not taken)
            fallback = in_reference_form(swap.reference, qparams)
            given, got = calls[swap.name]
            expected = fallback(given)
            step = float(qparams.scale) if qparams.scale.numel() == 1 else None
            problem = output_violation(got, expected, expected.dtype, step)
            if problem:
                copy_forward_hooks(swap.int8, fallback)
                model.set_submodule(swap.name, fallback)
                swap.int8, replaced = fallback, replaced + 1
                warn_user(f"{label}, module {swap.name!r}: its int8 kernel {CONTRACT_BROKEN} on "
                          f"the prepared model's first call ({problem}); it runs in reference form between "
                          "a dequantize and a quantize")
        del calls
        if replaced:
            restore()
            output = model(*example[0], **example[1])
        restore()
        reference = _reference_form(model, swaps)(*example[0], **example[1])
    problem = _drift(output, reference)
    if problem:
        warn_user(f"{label}: the int8 model is wrong on the prepared model's first call: {problem}, "
                  "while each int8 module agrees with its own reference computation, so an op eager convert "
                  "does not see as a module (called in forward(), or a FloatFunctional's) answers "
                  f"otherwise on this engine{_unseen_ops_hint(backend.engine)}")
