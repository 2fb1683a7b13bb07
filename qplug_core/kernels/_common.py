"""Helpers shared by the torch.ops.quantized kernel modules.

Every kernel caches its output scale/zero-point as Python numbers at build time: calling
``float(tensor)`` per forward would be a tensor->host sync on every call.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from qplug_core import qparams as Q
from qplug_core.errors import (
    BackendUnavailableError,
    ConfigValidationError,
    InputMismatchError,
    NumericOverflowError,
)
from qplug_core.kernels.base import KernelContext, TensorArg, engine_context, quiet_quantized_dtypes
from qplug_core.qparams import QParams

INT32_MAX = 2**31 - 1
#: largest reduction length K whose u8 x s8 products (255 * 128 each) cannot overflow an int32
MAX_REDUCTION_U8S8 = INT32_MAX // (255 * 128)  # 65,793

_ACTIVATION_DTYPES = (torch.quint8, torch.qint8)


def _deprecation_is_spent() -> bool:
    """True once torch's (warn-once) quantized-dtype deprecation warning can no longer fire.

    The first creation happens under :func:`quiet_quantized_dtypes` (every build packs a weight or
    quantizes a tensor that way); then a recorded second creation shows whether torch warns again.
    """
    with quiet_quantized_dtypes():
        torch.quantize_per_tensor(torch.zeros(1), 1.0, 0, torch.quint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.quantize_per_tensor(torch.zeros(1), 1.0, 0, torch.quint8)
    return not any("deprecated" in str(w.message) for w in caught)


@functools.lru_cache(maxsize=None)
def _forward_guard_is_needed() -> bool:
    return not _deprecation_is_spent()


def forward_quiet() -> ContextManager[None]:
    """The guard around the torch op a kernel's ``forward`` calls.

    Tensor subclasses' torch functions are off inside: before running ``torch.ops.quantized.*``,
    torch's Python binding looks ``__torch_function__`` up on every argument that is not a plain
    tensor, and on a packed-weight ``ScriptObject`` that failed lookup is a C++ exception turned
    into an ``AttributeError``, ~20 us per call: more than a small layer's int8 kernel (torch
    function modes still run). ``warnings.catch_warnings`` costs ~2-3 us per call and mutates the
    process-global filter list (not thread safe), so forwards silence the quantized-dtype
    deprecation only if torch would still emit it (it stopped being warn-once); builds always use
    :func:`quiet_quantized_dtypes`.
    """
    return _quiet_op() if _forward_guard_is_needed() else torch._C.DisableTorchFunctionSubclass()


@contextlib.contextmanager
def _quiet_op() -> Iterator[None]:
    with quiet_quantized_dtypes(), torch._C.DisableTorchFunctionSubclass():
        yield


def conv1d_layout(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as the 4-D channels-last tensor it is a view of when it has a quantized Conv1d's
    output layout (3-D, strides (C*L, 1, C): the 2-D conv's result squeezed), else None; torch's
    quantized kernels run fast on the 4-D view and take a strided path on the 3-D one."""
    if x.dim() != 3:
        return None
    view = x.unsqueeze(2)
    return view if view.is_contiguous(memory_format=torch.channels_last) else None


def activation_qparams(qp: QParams | None, what: str) -> tuple[float, int, torch.dtype]:
    """(scale, zero_point, dtype) of a per-tensor quint8/qint8 activation as Python numbers."""
    if qp is None:
        raise ConfigValidationError(f"{what}: qparams are missing", field=what, value=None)
    if qp.per_channel or qp.dtype not in _ACTIVATION_DTYPES:
        raise ConfigValidationError(
            f"{what}: activations must be per-tensor quint8/qint8, got dtype={qp.dtype} "
            f"axis={qp.axis}", field=what, value=qp)
    return float(qp.scale), int(qp.zero_point), qp.dtype


def output_qparams(ctx: KernelContext) -> tuple[float, int, torch.dtype]:
    return activation_qparams(ctx.output_qparams, "output_qparams")


def input_dtype(ctx: KernelContext, index: int = 0) -> torch.dtype:
    if len(ctx.input_qparams) <= index:
        raise ConfigValidationError(f"input_qparams[{index}] is missing", field="input_qparams",
                                    value=ctx.input_qparams)
    return activation_qparams(ctx.input_qparams[index], f"input_qparams[{index}]")[2]


def int_weight(weight: torch.Tensor, qp: QParams
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(integer values, scale, zero point) of ``weight`` under ``qp``, broadcastable to it.

    Rounds exactly as activations and the reference form do (``qparams.quantize_unclamped``, torch's
    float32 ``x * (1 / scale)``), so a weight on a rounding tie gets the same integer in every
    flow, then clamps to ``qp``'s range (which may be narrower than the dtype's).
    """
    if qp.per_channel and (not -weight.dim() <= qp.axis < weight.dim()
                           or qp.scale.numel() != weight.size(qp.axis)):
        raise ConfigValidationError(
            f"weight qparams: {qp.scale.numel()} per-channel scales on axis {qp.axis} do not fit a "
            f"weight of shape {tuple(weight.shape)}", field="weight_qparams", value=qp)
    q, scale, zp = Q.quantize_unclamped(weight, qp)
    return q.clamp(qp.quant_min, qp.quant_max).double(), scale.double(), zp.double()


def quantize_weight(weight: torch.Tensor, qp: QParams) -> torch.Tensor:
    """A torch quantized qint8 tensor of ``weight`` honouring ``qp``'s (possibly narrowed) range."""
    if qp.dtype != torch.qint8:
        raise ConfigValidationError(f"weights must be qint8 for torch.ops.quantized, got {qp.dtype}",
                                    field="weight_qparams.dtype", value=qp.dtype)
    q, scale, zp = int_weight(weight.detach(), qp)
    snapped = ((q - zp) * scale).float()  # exactly representable: quantizing it again is lossless
    with quiet_quantized_dtypes():
        if qp.per_channel:
            return torch.quantize_per_channel(snapped, qp.scale.double().flatten(),
                                              qp.zero_point.long().flatten(), qp.axis, torch.qint8)
        return torch.quantize_per_tensor(snapped, float(qp.scale), int(qp.zero_point), torch.qint8)


def check_reduction_length(k: int, op: str) -> None:
    """G12: refuse reductions whose worst-case u8 x s8 sum cannot fit the int32 accumulator."""
    if k > MAX_REDUCTION_U8S8:
        raise NumericOverflowError(
            f"{op}: reduction length K={k} exceeds {MAX_REDUCTION_U8S8} (= (2^31-1) // (255*128)); "
            f"a u8 x s8 int32 accumulator could overflow. Split the layer or keep it in float.")


def wrong_input_size(kernel: str, size: int, what: str, where: str, shape: tuple[int, ...]
                     ) -> InputMismatchError:
    """The error of an input with other than the ``size`` features (or channels) the kernel's weight
    takes: the ops check nothing (qnnpack reads past the input and answers, fbgemm says "packB ... K")."""
    plural = "" if size == 1 else "s"
    return InputMismatchError(
        f"int8 {kernel} takes inputs with {size} {what}{plural} ({where}), got shape {shape}: the "
        "model's inputs do not have the shape it was quantized for")


def split_fused_relu(module: nn.Module | None, kind: type | tuple[type, ...], op: str
                     ) -> tuple[nn.Module, bool]:
    """(weighted module, fused relu?) of a float module or a fused ``nn.Sequential``.

    Fused modules are Sequentials whose first child is the weighted module and which may end in
    ``nn.ReLU``; anything else in between (an unfolded BatchNorm) cannot be lowered.
    """
    relu = False
    if isinstance(module, nn.Sequential) and len(module) > 0:
        children = list(module)
        relu = len(children) > 1 and isinstance(children[-1], nn.ReLU)
        rest = children[1:-1] if relu else children[1:]
        if rest:
            raise ConfigValidationError(
                f"{op}: fused module {type(module).__name__} holds {[type(m).__name__ for m in rest]} "
                f"between the weighted module and the ReLU; fold them (fuse in eval mode) first",
                field="module", value=type(module).__name__)
        module = children[0]
    if not isinstance(module, kind):
        raise ConfigValidationError(
            f"{op}: expected a {kind} module (optionally fused with ReLU), got {type(module).__name__}",
            field="module", value=type(module).__name__)
    return module, relu


def ctx_param(ctx: KernelContext, name: str, position: int, default: Any) -> Any:
    """A hyper-parameter from the float module (attribute) or the functional call (kwarg/arg)."""
    if ctx.module is not None and hasattr(ctx.module, name):
        return getattr(ctx.module, name)
    if name in ctx.kwargs:
        return ctx.kwargs[name]
    if len(ctx.args) > position and not isinstance(ctx.args[position], TensorArg):
        return ctx.args[position]
    return default


def requantize_reference(x: torch.Tensor, scale: float, zp: int, dtype: torch.dtype) -> torch.Tensor:
    """Integer values of float ``x`` quantized with round-half-even and clamping (the oracle)."""
    info = torch.iinfo(torch.uint8 if dtype == torch.quint8 else torch.int8)
    return (torch.round(x.double() / scale) + zp).clamp(info.min, info.max)


def check_against(out: torch.Tensor, expected: torch.Tensor, name: str, engine: str,
                  max_lsb: int = 1) -> None:
    """Self-test verdict: every output element within ``max_lsb`` of the requantized reference."""
    ref = requantize_reference(expected, out.q_scale(), out.q_zero_point(), out.dtype)
    diff = (out.int_repr().double() - ref).abs().max().item() if ref.numel() else 0.0
    if diff > max_lsb:
        raise BackendUnavailableError(
            f"{name} self-test on engine {engine!r}: output differs from the float reference by "
            f"{diff:.0f} LSB (allowed {max_lsb})", backend=engine)


def quantize_input(x: torch.Tensor, scale: float, zp: int, dtype: torch.dtype = torch.quint8
                   ) -> torch.Tensor:
    with quiet_quantized_dtypes():
        return torch.quantize_per_tensor(x, scale, zp, dtype)


def per_tensor_qparams(scale: float, zero_point: int, dtype: torch.dtype = torch.quint8,
                       quant_min: int | None = None, quant_max: int | None = None) -> QParams:
    """A per-tensor :class:`QParams` (self-tests and weight-only builders)."""
    info = torch.iinfo(torch.uint8 if dtype == torch.quint8 else torch.int8)
    return QParams(torch.tensor(scale, dtype=torch.float32), torch.tensor(zero_point),
                   dtype, info.min if quant_min is None else quant_min,
                   info.max if quant_max is None else quant_max)


def output_qparams_for(expected: torch.Tensor, dtype: torch.dtype = torch.quint8) -> QParams:
    """Affine qparams covering ``expected`` (and 0): what a min/max observer would pick."""
    lo, hi = min(expected.min().item(), 0.0), max(expected.max().item(), 0.0)
    scale = max((hi - lo) / 255.0, 1e-4)
    info = torch.iinfo(torch.uint8 if dtype == torch.quint8 else torch.int8)
    zp = int(min(max(info.min - round(lo / scale), info.min), info.max))
    return per_tensor_qparams(scale, zp, dtype)


#: self-test activations: integers in [0, 127] (no vpmaddubsw pair saturation) around zp 64
SELF_TEST_INPUT = per_tensor_qparams(0.02, 64)


class KernelModule(nn.Module):
    """Base of the kernel modules: ``from_context`` builds, ``self_test`` checks one tiny case."""

    @classmethod
    def from_context(cls, ctx: KernelContext) -> KernelModule:
        raise NotImplementedError

    @classmethod
    def _self_test_case(cls, engine: str) -> tuple[KernelContext, Callable[..., torch.Tensor],
                                                     tuple[tuple[int, ...], ...]]:
        """(context without output qparams, float reference function, input shapes)."""
        raise NotImplementedError

    @classmethod
    def _self_test_output(cls, expected: torch.Tensor) -> QParams:
        return output_qparams_for(expected)

    @classmethod
    def self_test(cls, engine: str) -> None:
        """Build and run a tiny instance on ``engine``; raise if it misses the float reference."""
        gen = torch.Generator().manual_seed(0)
        ctx, reference, shapes = cls._self_test_case(engine)
        quantized = []
        for shape, qp in zip(shapes, ctx.input_qparams):
            s, zp, dtype = activation_qparams(qp, "input_qparams")
            ints = torch.randint(0, 128, shape, generator=gen).double()
            quantized.append(quantize_input(((ints - zp) * s).float(), s, zp, dtype))
        expected = reference(*(q.dequantize() for q in quantized))
        ctx.output_qparams = cls._self_test_output(expected)
        ctx.engine = engine
        try:
            module = cls.from_context(ctx)
            with engine_context(engine):  # unpacked ops dispatch on the global engine
                out = module(*quantized)
        except RuntimeError as e:
            raise BackendUnavailableError(f"{cls.__name__} self-test on engine {engine!r} failed: "
                                          f"{e}", backend=engine) from e
        check_against(out, expected, cls.__name__, engine)
