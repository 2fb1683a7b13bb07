"""Eager convert asks a passthrough module's ``KernelSpec.check`` whether int8 tensors may run it,
as lowering asks for each passthrough region in graph mode.

Unobserved modules (upsampling, padding) run on the int8 tensors they get, and torch gets some of
their calls wrong: its int8 bilinear upsampling of a 1x1 map (a global-pool branch, DeepLab's
ASPP) is up to 250 steps off. The checks refuse such a call by its input's shape, which graph mode
takes from its example inputs; eager mode has no graph, so prepare notes the input shapes each
such module is called with (:func:`note_input_shapes`), and convert runs a module the check refuses
on dequantized values.
"""

from __future__ import annotations

from torch import nn

from qplug_core.errors import ConstraintViolationError
from qplug_core.flows.tags import EAGER_INPUT_SHAPES
from qplug_core.ir.hooks import drop_pre_hooks
from qplug_core.kernels.base import KernelContext, KernelSpec, TensorArg
from qplug_core.kernels.passthrough import PASSTHROUGH_CHECKS


def _note_shape(module: nn.Module, args: tuple) -> None:
    if args and hasattr(args[0], "shape"):
        module.__dict__[EAGER_INPUT_SHAPES].add(tuple(args[0].shape))


def note_input_shapes(module: nn.Module) -> None:
    """Note the input shapes of ``module`` from now on, if it is a passthrough op some of whose calls
    int8 kernels refuse."""
    if type(module) in PASSTHROUGH_CHECKS:
        module.__dict__[EAGER_INPUT_SHAPES] = set()
        module.register_forward_pre_hook(_note_shape)


def noted_input_shapes(model: nn.Module) -> dict[str, set[tuple[int, ...]]]:
    """Module name -> the input shapes noted for it, taken off ``model`` with the hooks noting them."""
    noted = {}
    for name, module in model.named_modules():
        if EAGER_INPUT_SHAPES in module.__dict__:
            drop_pre_hooks(module, lambda hook: hook is _note_shape)
            noted[name] = module.__dict__.pop(EAGER_INPUT_SHAPES)
    return noted


def refusal(spec: KernelSpec | None, module: nn.Module, shapes: set[tuple[int, ...]], engine: str | None) -> str:
    """Why ``spec``'s check refuses a call of ``module`` with an input of one of ``shapes`` ('' if it
    takes them all, or has no check)."""
    if spec is None or not spec.passthrough or spec.check is None:
        return ""
    for shape in sorted(shapes) or [None]:
        ctx = KernelContext(pattern=type(module), module=module, target=None, args=(TensorArg(0),),
                            engine=engine, input_shapes=(shape,) if shape is not None else ())
        try:
            spec.check(ctx)
        except ConstraintViolationError as refused:
            return str(refused)
    return ""
