"""Kernel contract shared by the core's lowering pass and the backend plugins.

A backend registers, for a quantization pattern (complex format, the same key as its
``BackendPatternConfig``), a :class:`KernelSpec`. At convert time the lowering pass hands the spec's
``build`` a :class:`KernelContext` describing one matched instance (float module, qparams of every
quantized input, the output and the weight) and puts the returned module into the graph. What the
module's ``forward`` receives and returns depends on the kind of pattern (docs/plugins/kernels.md):

* static: per-tensor quantized tensors (``quint8``/``qint8``, made by the ``"quantize"`` boundary
  kernel) in the order of ``input_qparams``, and it returns one with ``output_qparams``; read an
  input with :func:`int_values`, build the output with :func:`quantized_from_int`;
* dynamic (``input_qparams[0].is_dynamic``) and weight-only: float tensors in and out.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from qplug_core.errors import ConfigValidationError, ModelStateError
from qplug_core.ir.hooks import keep_in_copies
from qplug_core.ir.tracing import refuse_pickle, refuse_script, warn_state_dict_incomplete
from qplug_core.kernels import engine_lease
from qplug_core.qparams import QParams

#: torch >= 2.13 deprecates tensors with dtypes quint8/qint8/qint32; the kernels we wrap still need
#: them, so the warning is silenced exactly around the calls that create such tensors.
_QUANTIZED_DTYPE_WARNING = r".*quantized tensor creation functions.*deprecated.*|.*quint8.*deprecated.*"

@contextlib.contextmanager
def quiet_quantized_dtypes() -> Iterator[None]:
    """Silence torch's deprecation warning for quantized dtypes inside this block only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_QUANTIZED_DTYPE_WARNING)
        yield


@contextlib.contextmanager
def engine_context(engine: str | None) -> Iterator[None]:
    """Run a block (weight packing) under ``engine`` and restore the user's engine afterwards.

    Packed weights remember the engine they were packed for, so running them needs no switch;
    only packing does. ``None`` leaves the engine alone. Threads needing another engine wait
    until the block ends (:mod:`~qplug_core.kernels.engine_lease`).
    """
    if engine is None:
        yield
        return
    token = engine_lease.acquire(engine)
    try:
        with quiet_quantized_dtypes():
            yield
    finally:
        engine_lease.release(token)


_INT_RANGE = {torch.quint8: (0, 255), torch.qint8: (-128, 127)}


def int_values(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """A static kernel's quantized input as ``(integers, scale, zero_point)``, all public torch API.

    ``x`` is per-tensor quantized (what the ``"quantize"`` boundary kernel produces); the integers
    are ``x.int_repr()`` (``uint8`` for quint8, ``int8`` for qint8) and ``x == (q - zp) * scale``.
    """
    return x.int_repr(), float(x.q_scale()), int(x.q_zero_point())


def quantized_from_int(values: torch.Tensor, scale: float, zero_point: int,
                       dtype: torch.dtype = torch.quint8) -> torch.Tensor:
    """The per-tensor quantized tensor holding the integers ``values``: what a static kernel returns.

    ``values`` (any integer or float dtype) are rounded half to even and saturated to ``dtype``'s
    range; the result has exactly those integers, ``scale`` and ``zero_point``. Built through
    ``torch.quantize_per_tensor`` on the exactly representable float values, so no private torch
    function is needed, and without torch's deprecation warning for quantized dtypes.
    """
    if dtype not in _INT_RANGE:
        raise ConfigValidationError(f"quantized_from_int: dtype must be torch.quint8 or torch.qint8, "
                                    f"got {dtype}", field="dtype", value=dtype)
    low, high = _INT_RANGE[dtype]
    q = torch.round(values.to(torch.float64)).clamp(low, high)
    with quiet_quantized_dtypes():
        return torch.quantize_per_tensor(((q - zero_point) * scale).float(), float(scale),
                                         int(zero_point), dtype)


class SwappedLayer(nn.Module):
    """Base of the modules qplug puts in place of a float layer when it quantizes a model, so that
    quantizing that model again is refused (:func:`~qplug_core.flows.checks.refuse_quantized`).

    Pickling and ``torch.jit.script`` are refused as for graph-mode models (a pickled layer
    carries kernels chosen for the CPU that quantized it, and unpickling runs code); a deep copy
    copies the attributes itself, since ``copy.deepcopy`` would otherwise go through ``__reduce_ex__``.
    """

    __reduce_ex__ = refuse_pickle  # type: ignore[assignment]
    __reduce__ = refuse_pickle  # type: ignore[assignment]
    __prepare_scriptable__ = refuse_script

    def __deepcopy__(self, memo: dict) -> SwappedLayer:
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            clone.__dict__[key] = copy.deepcopy(value, memo)
        return clone


class PackedStateModule(SwappedLayer):
    """Base of kernels whose int8 weights live in torch's packed objects, outside ``state_dict``.

    ``load_state_dict`` could restore nothing into them, and used to succeed silently while every
    output stayed as before; it is refused instead, pointing at the ways that do round-trip.
    """

    def __deepcopy__(self, memo: dict) -> PackedStateModule:
        """A copy whose packed weights are packed again under this kernel's ``engine``: torch's
        packed objects repack under the global engine when copied, so a deep copy of an fbgemm
        model ran (and answered as) whatever engine was global, while saying ``engine='fbgemm'``."""
        with engine_context(getattr(self, "engine", None)):
            return super().__deepcopy__(memo)  # type: ignore[return-value]

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        warn_state_dict_incomplete(destination)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        where = prefix.rstrip(".") or "the root module"
        raise ModelStateError(
            f"load_state_dict cannot restore {type(self).__name__} at {where!r}: its int8 weights "
            "are packed outside the state_dict. Save and load graph-mode models with qp.save / "
            "qp.load (eager-mode models cannot be saved); otherwise load the float weights into the "
            "float model and quantize it again.")


class PackedHolder(nn.Module):
    """One packed object (an RNN layer's cell) as a submodule's attribute: ``torch.jit.trace``
    reaches packed objects only there (a plain list of them failed as "not part of the active
    trace"); torch's own dynamic LSTM keeps its cells the same way."""

    def __init__(self, param: object):
        super().__init__()
        self.param = param


#: .calls: ``[model, lease token]`` per pinned model whose forward this thread is in, innermost last
_ENTERED = threading.local()


class _EnterEngine:
    """Forward pre-hook: hold a lease on ``engine`` for the model's forward."""

    def __init__(self, engine: str) -> None:
        self.engine = engine

    def __call__(self, module: nn.Module, args: Any) -> None:
        entry: list[Any] = [module, None]  # the token, once held: a recursive call's hook pops its own entry
        calls = _ENTERED.__dict__.setdefault("calls", [])
        calls.append(entry)
        try:
            entry[1] = engine_lease.acquire(self.engine)
        except BaseException as error:
            if not isinstance(error, Exception):  # torch runs no forward hook then
                calls.pop()
            raise


def _leave_engine(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook (always called, also on errors): end the lease this call's pre-hook took, if it
    took one (a pre-hook before it may have raised)."""
    calls = getattr(_ENTERED, "calls", None)
    if calls and calls[-1][0] is module:
        token = calls.pop()[1]
        if token is not None:
            engine_lease.release(token)


def pin_engine(model: nn.Module, engine: str | None) -> nn.Module:
    """Make ``model``'s forward run under ``engine`` whatever the global engine is; returns it.

    Ops without packed weights (clamp, hardtanh, pooling, add, cat on quantized tensors) dispatch
    on the *global* engine at call time, so a model converted for fbgemm gave other numbers (and
    ran slower) once someone set qnnpack. Two hooks on the root hold a lease on the engine for the
    forward (:mod:`~qplug_core.kernels.engine_lease`): threads running models of the same engine run
    together, one needing another engine waits, and the caller's engine is back once none runs.
    """
    if engine is None or any(isinstance(h, _EnterEngine) for h in model._forward_pre_hooks.values()):
        return model
    model.register_forward_pre_hook(_EnterEngine(engine), prepend=True)
    model.register_forward_hook(_leave_engine, always_call=True)
    keep_in_copies(model)
    return model


@dataclass(frozen=True)
class TensorArg:
    """Stands in ``KernelContext.args`` for the i-th quantized tensor input of the kernel."""

    index: int


@dataclass
class KernelContext:
    """One matched, calibrated pattern instance, ready to be turned into an int8 module.

    ``module`` is the float root module after fusion (``nn.Conv2d``, a fused ``ConvReLU2d``, ...) or
    ``None`` for functional patterns, whose anchor target is in ``target``. ``args``/``kwargs`` are
    the anchor node's arguments with quantized tensor inputs replaced by :class:`TensorArg`.
    A recurrent layer (``nn.LSTM``, ``nn.GRU``, a cell) has one weight qparams per weight matrix,
    in ``recurrent_weight_qparams`` by parameter name; ``weight_qparams`` is the first one's.
    ``input_shapes``: the shape the example inputs gave each quantized tensor input, in
    ``input_qparams``' order (empty where none were recorded), for a check that refuses by rank.
    """

    pattern: Any
    module: nn.Module | None
    target: Any
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    input_qparams: tuple[QParams, ...] = ()
    output_qparams: QParams | None = None
    weight_qparams: QParams | None = None
    engine: str | None = None
    recurrent_weight_qparams: dict[str, QParams] | None = None
    input_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def root(self) -> nn.Module | None:
        """The module holding the weight: ``module[0]`` of a fused module (``LinearReLU``,
        ``ConvBnReLU2d``: an ``nn.Sequential`` whose first child is the weighted op), else
        ``module`` itself. ``ctx.root.weight`` is the calibrated float weight either way."""
        if isinstance(self.module, nn.Sequential) and len(self.module):
            return self.module[0]
        return self.module

    @property
    def fused(self) -> tuple[nn.Module, ...]:
        """The modules fused after the root (``(nn.ReLU(),)`` for ``LinearReLU``), else ``()``."""
        return tuple(self.module)[1:] if isinstance(self.module, nn.Sequential) else ()


#: keys of a backend's kernel table for the boundary modules (every other key is a pattern)
QUANTIZE_KEY = "quantize"
DEQUANTIZE_KEY = "dequantize"


@dataclass(frozen=True)
class KernelSpec:
    """How a backend runs one quantized pattern.

    ``build(ctx)`` returns the int8 module (packing weights under ``ctx.engine``). A ``passthrough``
    kernel needs no module: the original op runs unchanged on the backend's quantized tensors (shape
    ops, max pooling), so lowering just removes the dequantize/quantize pair around it. Its
    ``check(ctx)`` raises :class:`ConstraintViolationError`, as ``build`` does, for a call the op
    cannot run on quantized tensors (an upsampling mode torch has no quantized kernel for), which
    would otherwise raise at every call of the converted model: that region keeps the reference form.
    ``self_test()`` raises if the kernel is unusable on this machine; lowering then falls back to
    the reference form with a warning.
    """

    op: str
    build: Callable[[KernelContext], nn.Module] | None = None
    passthrough: bool = False
    self_test: Callable[[], None] | None = None
    check: Callable[[KernelContext], None] | None = None

    def __post_init__(self) -> None:
        if (self.build is None) == (not self.passthrough):
            raise ConfigValidationError(
                f"KernelSpec {self.op!r}: give exactly one of build=... or passthrough=True",
                field="build", value=self.build)
        if self.check is not None and not self.passthrough:
            raise ConfigValidationError(
                f"KernelSpec {self.op!r}: check=... goes with passthrough=True (a build refuses an "
                "instance itself, raising ConstraintViolationError)", field="check", value=self.check)
