"""Element-wise and activation kernels: add/mul(+relu), matmul, bmm, mm, cat, hardswish, silu, elu, leaky_relu,
softmax, and the fixed-qparams sigmoid/tanh/hardsigmoid.

These ops carry no packed state, so torch dispatches them by the *global* engine at run time
(qnnpack's add is used only while the global engine is qnnpack); both paths agree within 1 LSB.
"""

from __future__ import annotations

import numbers
from typing import Callable

import torch
import torch.nn.functional as F
from torch import fx, nn

from qplug_core.errors import ConfigValidationError, ConstraintViolationError, input_mismatch
from qplug_core.kernels._common import (
    SELF_TEST_INPUT,
    KernelModule,
    conv1d_layout,
    ctx_param,
    forward_quiet,
    input_dtype,
    output_qparams,
    per_tensor_qparams,
)
from qplug_core.kernels.base import KernelContext, TensorArg
from qplug_core.qparams import QParams

_Q = torch.ops.quantized
UnaryOp = Callable[[torch.Tensor, float, int], torch.Tensor]


def _scalar_operand(ctx: KernelContext, op: str) -> float:
    """The Python-number operand of ``x + c`` / ``c * x``."""
    candidates = [*ctx.args, *ctx.kwargs.values()]
    numbers_ = [a for a in candidates if isinstance(a, numbers.Real) and not isinstance(a, bool)]
    float_tensors = [a for a in candidates if isinstance(a, fx.Node)]
    if not numbers_ and float_tensors:  # ``x * attention_mask[..., None]``: the mask is no int8 value
        raise ConstraintViolationError(
            f"{op}: its other operand, {float_tensors[0].name!r}, is a tensor that is not quantized (an "
            "integer mask, say); the kernel takes two quantized tensors or one and a Python number, "
            "so this op stays in reference form", field="args", value=float_tensors[0].name)
    if len(numbers_) != 1:
        raise ConfigValidationError(
            f"{op}: with one quantized input, exactly one Python number operand is expected; "
            f"got args={ctx.args!r} kwargs={ctx.kwargs!r}", field="args", value=ctx.args)
    return float(numbers_[0])


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def _same_channels_last(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both operands dense channels-last of the same rank (not also plain contiguous: C or H*W is 1)."""
    fmt = _CHANNELS_LAST.get(a.dim())
    return (fmt is not None and a.dim() == b.dim() and not (a.is_contiguous() and b.is_contiguous())
            and a.is_contiguous(memory_format=fmt) and b.is_contiguous(memory_format=fmt))


def _tensor_operands(ctx: KernelContext) -> int:
    return sum(isinstance(a, TensorArg) for a in [*ctx.args, *ctx.kwargs.values()])


class _Binary(KernelModule):
    """quantized (+|*) quantized -> requantized output, or quantized (+|*) Python scalar.

    The scalar ops choose their own output qparams; if they differ from the calibrated ones the
    result is requantized so the graph sees exactly ``ctx.output_qparams``.
    """

    _tensor_op: Callable[..., torch.Tensor]
    _scalar_op: Callable[..., torch.Tensor]
    _reference: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __init__(self, scale: float, zero_point: int, dtype: torch.dtype, scalar: float | None):
        super().__init__()
        self.scale, self.zero_point, self.dtype, self.scalar = scale, zero_point, dtype, scalar

    @classmethod
    def from_context(cls, ctx: KernelContext) -> _Binary:
        scale, zp, dtype = output_qparams(ctx)
        two_tensors = len(ctx.input_qparams) >= 2 or _tensor_operands(ctx) >= 2  # x + x: one input
        scalar = None if two_tensors else _scalar_operand(ctx, cls.__name__)
        return cls(scale, zp, dtype, scalar)

    def forward(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        with forward_quiet():
            if self.scalar is None:  # ``b`` is None when both operands are the same tensor
                return self._on_fast_layout(a, a if b is None else b)
            y = type(self)._scalar_op(a, self.scalar)
            if y.q_scale() == self.scale and y.q_zero_point() == self.zero_point:
                return y
            return torch.quantize_per_tensor(y.dequantize(), self.scale, self.zero_point, self.dtype)

    def _on_fast_layout(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The op on operands in a layout torch's kernels run fast: contiguous, or channels-last.

        Two 4-D (5-D) channels-last operands, the quantized convs' outputs, are passed as they are
        and the result keeps that layout: copying them to NCHW cost 6 copies per ResNet forward
        and left the pooling behind the add ~25x slower on the layout it did not expect.
        A quantized Conv1d returns its 2-D conv's channels-last result squeezed to 3-D (strides
        (C*L, 1, C)); torch's add of such tensors took a strided path 20x slower (847 vs 44 us at
        64 x 2000), so they run on their 4-D channels-last view. Any other non-contiguous operand
        (a slice, mixed layouts) is copied contiguous first.
        """
        op = type(self)._tensor_op
        if _same_channels_last(a, b):
            return op(a, b, self.scale, self.zero_point)
        a4, b4 = conv1d_layout(a), conv1d_layout(b)
        if a4 is not None and b4 is not None:
            return op(a4, b4, self.scale, self.zero_point).squeeze(2)
        return op(a.contiguous(), b.contiguous(), self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, zero_point={self.zero_point}, scalar={self.scalar}"

    @classmethod
    def _self_test_case(cls, engine: str):
        ctx = KernelContext(pattern=cls.__name__, module=None, target=cls.__name__,
                            args=(TensorArg(0), TensorArg(1)),
                            input_qparams=(SELF_TEST_INPUT, SELF_TEST_INPUT))
        return ctx, cls._reference, ((2, 3, 4), (2, 3, 4))


class Add(_Binary):
    """quantized.add / add_scalar."""

    _tensor_op, _scalar_op = _Q.add, _Q.add_scalar
    _reference = staticmethod(torch.add)


class AddReLU(_Binary):
    """quantized.add_relu / add_scalar_relu."""

    _tensor_op, _scalar_op = _Q.add_relu, _Q.add_scalar_relu
    _reference = staticmethod(lambda a, b: torch.relu(a + b))


class Mul(_Binary):
    """quantized.mul / mul_scalar."""

    _tensor_op, _scalar_op = _Q.mul, _Q.mul_scalar
    _reference = staticmethod(torch.mul)


class MulReLU(_Binary):
    """quantized.mul_relu / mul_scalar_relu."""

    _tensor_op, _scalar_op = _Q.mul_relu, _Q.mul_scalar_relu
    _reference = staticmethod(lambda a, b: torch.relu(a * b))


class Matmul(_Binary):
    """quantized.matmul of two quantized tensors (no scalar form)."""

    _tensor_op = _Q.matmul
    _reference = staticmethod(torch.matmul)

    def _on_fast_layout(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Contiguous operands: the add's 4-D view of two Conv1d outputs changes which dims a
        matmul multiplies ((N, C, L) @ (N, L, M) raised a size mismatch)."""
        return _Q.matmul(a.contiguous(), b.contiguous(), self.scale, self.zero_point)

    #: the operand shapes the self-test multiplies
    _self_test_shapes: tuple[tuple[int, ...], ...] = ((2, 3, 4), (2, 4, 5))

    @classmethod
    def _self_test_case(cls, engine: str):
        ctx, reference, _ = super()._self_test_case(engine)
        return ctx, reference, cls._self_test_shapes


class Bmm(Matmul):
    """``torch.bmm`` on quantized.matmul, which broadcasts and takes any rank: operands torch.bmm
    refuses (not 3-D, other batch sizes) are refused here too, not multiplied as a matmul would."""

    _reference = staticmethod(torch.bmm)
    #: the op's name, the rank of both operands and their shapes, as torch's error would say
    _name, _rank, _shapes = "bmm", 3, "(b, n, m) and (b, m, p)"

    def _on_fast_layout(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # not while torch.jit.trace records the call (as the linear's check): its sizes are traced values
        if not torch.jit.is_tracing() and (a.dim() != self._rank or b.dim() != self._rank
                                           or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]):
            raise input_mismatch(
                f"int8 {self._name} takes two {self._rank}-D tensors {self._shapes}, as torch.{self._name} "
                f"does; got shapes {tuple(a.shape)} and {tuple(b.shape)}", RuntimeError)
        return super()._on_fast_layout(a, b)


class Mm(Bmm):
    """``torch.mm`` on quantized.matmul: two 2-D operands only, as torch.mm takes."""

    _reference = staticmethod(torch.mm)
    _name, _rank, _shapes = "mm", 2, "(n, m) and (m, p)"
    _self_test_shapes = ((3, 4), (4, 5))


class Cat(KernelModule):
    """quantized.cat: inputs with different qparams are requantized to the output's."""

    def __init__(self, dim: int, scale: float, zero_point: int):
        super().__init__()
        self.dim, self.scale, self.zero_point = dim, scale, zero_point

    @classmethod
    def from_context(cls, ctx: KernelContext) -> Cat:
        scale, zp, _ = output_qparams(ctx)
        return cls(int(ctx_param(ctx, "dim", 1, 0)), scale, zp)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        with forward_quiet():
            return _Q.cat(list(tensors), self.dim, self.scale, self.zero_point)

    @classmethod
    def _self_test_case(cls, engine: str):
        ctx = KernelContext(pattern="cat", module=None, target=torch.cat,
                            args=([TensorArg(0), TensorArg(1)], 1),
                            input_qparams=(SELF_TEST_INPUT, SELF_TEST_INPUT))
        return ctx, lambda a, b: torch.cat([a, b], 1), ((2, 3, 4), (2, 5, 4))


class _Unary(KernelModule):
    """One quantized input, an op taking the output scale/zero-point."""

    def __init__(self, op: UnaryOp, scale: float, zero_point: int):
        super().__init__()
        self._op, self.scale, self.zero_point = op, scale, zero_point

    @classmethod
    def _make_op(cls, ctx: KernelContext) -> UnaryOp:
        raise NotImplementedError

    @classmethod
    def _float_module(cls) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def from_context(cls, ctx: KernelContext) -> _Unary:
        scale, zp, _ = output_qparams(ctx)
        return cls(cls._make_op(ctx), scale, zp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with forward_quiet():
            return self._op(x, self.scale, self.zero_point)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, zero_point={self.zero_point}"

    @classmethod
    def _self_test_case(cls, engine: str):
        mod = cls._float_module()
        ctx = KernelContext(pattern=cls.__name__, module=mod, target=type(mod), args=(TensorArg(0),),
                            input_qparams=(SELF_TEST_INPUT,))
        return ctx, mod, ((2, 3, 8),)


class Hardswish(_Unary):
    """quantized.hardswish."""

    @classmethod
    def _make_op(cls, ctx: KernelContext) -> UnaryOp:
        return _Q.hardswish

    @classmethod
    def _float_module(cls) -> nn.Module:
        return nn.Hardswish()


def _silu(x: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """dequantize -> silu -> quantize: torch has no quantized silu. Measured on the host (64x64x64,
    1 thread) this is exact and the fastest option: 0.74 ms, vs 1.35 ms for a 256-entry table on the
    codes and 1.54 ms (1 LSB off) for ``x * quantized.sigmoid(x)``; it keeps the int8 value flowing
    so the cat/pool/add behind a Conv-BN-SiLU stay int8. A Conv1d's output is computed on its 4-D
    channels-last view (as the boundaries do): the 3-D strided quantize is the slow path."""
    view = conv1d_layout(x)
    y = torch.quantize_per_tensor(F.silu((x if view is None else view).dequantize()), scale,
                                  zero_point, x.dtype)
    return y if view is None else y.squeeze(2)


class SiLU(_Unary):
    """``nn.SiLU`` / ``F.silu`` on a quantized tensor (see :func:`_silu`)."""

    @classmethod
    def _make_op(cls, ctx: KernelContext) -> UnaryOp:
        return _silu

    @classmethod
    def _float_module(cls) -> nn.Module:
        return nn.SiLU()


class ELU(_Unary):
    """quantized.elu with the module's / call's ``alpha``."""

    @classmethod
    def _make_op(cls, ctx: KernelContext) -> UnaryOp:
        alpha = float(ctx_param(ctx, "alpha", 1, 1.0))
        return lambda x, scale, zp: _Q.elu(x, scale, zp, alpha, 1.0, 1.0)

    @classmethod
    def _float_module(cls) -> nn.Module:
        return nn.ELU(alpha=0.7)


class LeakyReLU(_Unary):
    """quantized.leaky_relu with ``negative_slope``."""

    @classmethod
    def _make_op(cls, ctx: KernelContext) -> UnaryOp:
        slope = float(ctx_param(ctx, "negative_slope", 1, 0.01))
        return lambda x, scale, zp: _Q.leaky_relu(x, slope, False, scale, zp)

    @classmethod
    def _float_module(cls) -> nn.Module:
        return nn.LeakyReLU(0.1)


class Softmax(_Unary):
    """quantized.softmax along ``dim``."""

    @classmethod
    def _make_op(cls, ctx: KernelContext) -> UnaryOp:
        dim = ctx_param(ctx, "dim", 1, None)
        if dim is None:
            raise ConfigValidationError("Softmax: an explicit dim is required", field="dim")
        return lambda x, scale, zp: _Q.softmax(x, int(dim), scale, zp)

    @classmethod
    def _float_module(cls) -> nn.Module:
        return nn.Softmax(dim=-1)


#: output (scale, zero_point) torch's quantized tanh / hardsigmoid always produce, by input dtype
FIXED_QPARAMS: dict[str, dict[torch.dtype, tuple[float, int]]] = {
    "tanh": {torch.quint8: (2.0 / 256, 128), torch.qint8: (2.0 / 256, 0)},
    "hardsigmoid": {torch.quint8: (1.0 / 256, 0), torch.qint8: (1.0 / 256, -128)},
    # quantized.sigmoid takes any output qparams on fbgemm, but qnnpack accepts only 1/256
    "sigmoid": {torch.quint8: (1.0 / 256, 0), torch.qint8: (1.0 / 256, -128)},
}


class _FixedQParams(_Unary):
    """Ops whose quantized output qparams are fixed by torch; the backend config must use them."""

    _name: str
    _fn: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def from_context(cls, ctx: KernelContext) -> _FixedQParams:
        scale, zp, dtype = output_qparams(ctx)
        fixed = FIXED_QPARAMS[cls._name][input_dtype(ctx)]
        if (abs(scale - fixed[0]) > 1e-9 or zp != fixed[1]) or dtype != input_dtype(ctx):
            raise ConstraintViolationError(
                f"{cls.__name__}: quantized {cls._name} outputs scale={fixed[0]}, zero_point="
                f"{fixed[1]}; configure fixed output qparams, got scale={scale}, zero_point={zp}",
                field="output_qparams", value=(scale, zp))
        fn = cls._fn
        return cls(lambda x, scale, zp: fn(x), scale, zp)

    @classmethod
    def _self_test_output(cls, expected: torch.Tensor) -> QParams:
        return per_tensor_qparams(*FIXED_QPARAMS[cls._name][SELF_TEST_INPUT.dtype])


class Sigmoid(_FixedQParams):
    """``torch.sigmoid`` on a quantized tensor (output scale 1/256)."""

    _name, _fn = "sigmoid", staticmethod(torch.sigmoid)

    @classmethod
    def _float_module(cls) -> nn.Module:
        return nn.Sigmoid()


class Tanh(_FixedQParams):
    """``torch.tanh`` on a quantized tensor (output scale 2/256)."""

    _name, _fn = "tanh", staticmethod(torch.tanh)

    @classmethod
    def _float_module(cls) -> nn.Module:
        return nn.Tanh()


class Hardsigmoid(_FixedQParams):
    """``F.hardsigmoid`` on a quantized tensor (output scale 1/256)."""

    _name, _fn = "hardsigmoid", staticmethod(F.hardsigmoid)

    @classmethod
    def _float_module(cls) -> nn.Module:
        return nn.Hardsigmoid()
