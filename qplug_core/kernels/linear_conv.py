"""Static int8 Linear / Conv{1,2,3}d / ConvTranspose{1,2,3}d over torch.ops.quantized.

Weights are quantized with the calibrated weight qparams and packed once, under the target engine;
the packed object remembers its engine, so ``forward`` runs without touching the global engine.
Bias stays float, as the ops take it.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from qplug_core.errors import (
    BackendUnavailableError,
    ConfigValidationError,
    ConstraintViolationError,
    InputMismatchError,
    warn_user,
)
from qplug_core.kernels._common import (
    SELF_TEST_INPUT,
    KernelModule,
    activation_qparams,
    check_against,
    check_reduction_length,
    forward_quiet,
    output_qparams,
    per_tensor_qparams,
    quantize_input,
    quantize_weight,
    split_fused_relu,
    wrong_input_size,
)
from qplug_core.kernels.base import KernelContext, PackedStateModule, TensorArg, engine_context
from qplug_core.kernels.capabilities import EngineCapabilities, engine_capabilities
from qplug_core.kernels.int32_bias import fit_bias, overflow_note
from qplug_core.qparams import QParams

_Q = torch.ops.quantized


def fit_bias_scale(mod: nn.Module, wqp: QParams, input_qp: QParams, caps: EngineCapabilities,
                   op: str) -> QParams:
    """Weight qparams whose int32 bias plus dot product cannot overflow (row 32, ``int32_bias.py``).

    Engines that add the bias in float (fbgemm) need nothing. Engines that quantize it (qnnpack)
    silently produce garbage past 2^31-1; convert has fitted the scales already, this catches a
    kernel built from other qparams. The change is reported with a ``RuntimeWarning``.
    """
    if caps.float_bias:
        return wqp
    fitted, changed = fit_bias(mod, wqp, input_qp)
    if changed:
        warn_user(f"{overflow_note(op, changed)} on engine {caps.engine!r}", RuntimeWarning)
    return fitted


class _PackedWeightKernel(KernelModule, PackedStateModule):
    """Shared build/run of the weighted kernels; subclasses say which module and which ops."""

    _float_type: type[nn.Module]
    #: per-channel weight axis torch's packing expects (0, or 1 for transposed conv)
    _channel_axis = 0
    #: the capability flag that allows per-channel weights
    _per_channel_flag = "per_channel_conv"
    #: the capability flag that says the op works at all on the engine (None: always)
    _op_flag: str | None = None

    #: the input dimension holding the features or channels the weight takes
    _input_axis = 1
    #: the float module's read-only geometry the kernel answers too, as torch.ao's quantized modules
    #: do: model code reads it (Whisper's ``generate()`` reads ``conv1.stride``, heads ``in_features``)
    _GEOMETRY: tuple[str, ...] = ("in_channels", "out_channels", "kernel_size", "stride", "padding",
                                  "dilation", "groups", "padding_mode")

    def __init__(self, packed: object, op: Callable[..., torch.Tensor], scale: float,
                 zero_point: int, engine: str, input_size: int):
        super().__init__()
        self._packed = packed
        self._op = op
        self.scale, self.zero_point, self.engine = scale, zero_point, engine
        self.input_size = input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # qnnpack reads past a wrongly sized input and answers (fbgemm: "packB ... K"): say so (not
        # while torch.jit.trace records the call: its sizes are traced values, which the check
        # would turn into Python bools with a TracerWarning each)
        if not torch.jit.is_tracing() and (not -x.dim() <= self._input_axis < x.dim()
                                           or x.shape[self._input_axis] != self.input_size):
            raise self._wrong_input(x)
        with forward_quiet():
            return self._op(x, self._packed, self.scale, self.zero_point)

    def _wrong_input(self, x: torch.Tensor) -> InputMismatchError:
        what, where = ("feature", "last dimension") if self._input_axis == -1 else ("channel", "dimension 1")
        return wrong_input_size(type(self).__name__, self.input_size, what, where, tuple(x.shape))

    def extra_repr(self) -> str:
        return (f"op={getattr(self._op, '__name__', self._op)}, scale={self.scale}, "
                f"zero_point={self.zero_point}, engine={self.engine!r}")

    # -- subclass hooks ------------------------------------------------------------------------

    @classmethod
    def _reduction_length(cls, mod: nn.Module) -> int:
        return mod.in_channels // mod.groups * math.prod(mod.kernel_size)

    @classmethod
    def _input_size(cls, mod: nn.Module) -> int:
        return mod.in_channels

    @classmethod
    def _check_module(cls, mod: nn.Module) -> None:
        """Raise for module settings the ops cannot express."""

    @classmethod
    def _pack(cls, mod: nn.Module, qweight: torch.Tensor) -> object:
        raise NotImplementedError

    @classmethod
    def _select_op(cls, relu: bool) -> Callable[..., torch.Tensor]:
        raise NotImplementedError

    # -- build ---------------------------------------------------------------------------------

    @classmethod
    def from_context(cls, ctx: KernelContext) -> _PackedWeightKernel:
        name = cls.__name__
        mod, relu = split_fused_relu(ctx.module, cls._float_type, name)
        scale, zp, _ = output_qparams(ctx)
        if not ctx.input_qparams:
            raise ConfigValidationError(f"{name}: input_qparams are missing", field="input_qparams")
        _, _, in_dtype = activation_qparams(ctx.input_qparams[0], "input_qparams[0]")
        engine = ctx.engine or torch.backends.quantized.engine
        caps = engine_capabilities(engine)
        wqp = ctx.weight_qparams
        if wqp is None:
            raise ConfigValidationError(f"{name}: weight_qparams are missing", field="weight_qparams")
        if cls._op_flag is not None and not getattr(caps, cls._op_flag):
            raise ConstraintViolationError(
                f"{name}: engine {engine!r} on torch {torch.__version__} has no working "
                f"{cls._op_flag} kernel (probe failed); keep this layer in float or use another "
                f"backend", field="engine", value=engine)
        if in_dtype == torch.qint8 and not caps.qint8_activations:
            raise ConstraintViolationError(
                f"{name}: engine {engine!r} on torch {torch.__version__} runs quantized "
                f"linear/conv on quint8 activations only; use quint8 activations",
                field="input_qparams[0].dtype", value=in_dtype)
        if wqp.per_channel and not getattr(caps, cls._per_channel_flag):
            raise ConstraintViolationError(
                f"{name}: engine {engine!r} on torch {torch.__version__} lacks per-channel weights "
                f"for this op ({cls._per_channel_flag}=False); use a per-tensor weight qconfig",
                field="weight_qparams.axis", value=wqp.axis)
        if wqp.per_channel and wqp.axis != cls._channel_axis:
            raise ConfigValidationError(
                f"{name}: per-channel weight axis must be {cls._channel_axis}, got {wqp.axis}",
                field="weight_qparams.axis", value=wqp.axis)
        cls._check_module(mod)
        check_reduction_length(cls._reduction_length(mod), name)
        wqp = fit_bias_scale(mod, wqp, ctx.input_qparams[0], caps, name)
        with engine_context(engine):
            packed = cls._pack(mod, quantize_weight(mod.weight, wqp))
        kernel = cls(packed, cls._select_op(relu), scale, zp, engine, cls._input_size(mod))
        for name in cls._GEOMETRY:
            setattr(kernel, name, getattr(mod, name))
        return kernel

    @classmethod
    def _self_test_module(cls) -> tuple[nn.Module, tuple[int, ...]]:
        raise NotImplementedError

    @classmethod
    def _self_test_case(cls, engine: str):
        mod, shape = cls._self_test_module()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # weights on the 0.01 grid: quantizing them is exact
            mod.weight.copy_(torch.randint(-20, 21, mod.weight.shape, generator=gen) * 0.01)
        ctx = KernelContext(pattern=cls.__name__, module=nn.Sequential(mod, nn.ReLU()), target=None,
                            args=(TensorArg(0),), input_qparams=(SELF_TEST_INPUT,),
                            weight_qparams=per_tensor_qparams(0.01, 0, torch.qint8))
        return ctx, ctx.module.eval(), (shape,)


class Linear(_PackedWeightKernel):
    """``nn.Linear`` (optionally fused with ReLU) -> quantized.linear / linear_relu."""

    _float_type = nn.Linear
    _per_channel_flag = "per_channel_linear"
    _input_axis = -1
    _GEOMETRY = ("in_features", "out_features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # nn.Linear takes one unbatched row (in_features,); the quantized ops take batches only
        if x.dim() == 1:
            return super().forward(x.unsqueeze(0)).squeeze(0)
        return super().forward(x)

    @classmethod
    def _reduction_length(cls, mod: nn.Module) -> int:
        return mod.in_features

    @classmethod
    def _input_size(cls, mod: nn.Module) -> int:
        return mod.in_features

    @classmethod
    def _pack(cls, mod: nn.Module, qweight: torch.Tensor) -> object:
        return _Q.linear_prepack(qweight, _float_bias(mod))

    @classmethod
    def _select_op(cls, relu: bool) -> Callable[..., torch.Tensor]:
        return _Q.linear_relu if relu else _Q.linear

    @classmethod
    def _self_test_module(cls) -> tuple[nn.Module, tuple[int, ...]]:
        return nn.Linear(16, 8), (4, 16)


def _float_bias(mod: nn.Module) -> torch.Tensor | None:
    return None if mod.bias is None else mod.bias.detach().float()


def _conv_padding(mod: nn.Module, name: str) -> list[int]:
    """Explicit padding for ``padding='valid'|'same'`` (the packed ops take numbers only)."""
    if not isinstance(mod.padding, str):
        return list(mod.padding)
    if mod.padding == "valid":
        return [0] * len(mod.kernel_size)
    totals = [d * (k - 1) for d, k in zip(mod.dilation, mod.kernel_size)]
    if any(t % 2 for t in totals):
        raise ConstraintViolationError(
            f"{name}: padding='same' with an even effective kernel needs asymmetric padding, which "
            f"the quantized conv ops cannot express", field="module.padding", value=mod.padding)
    return [t // 2 for t in totals]


_SPATIAL = {1: "L", 2: "H, W", 3: "D, H, W"}


class _ConvNd(_PackedWeightKernel):
    _dim: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's float convs take an unbatched (C, *spatial) input too; the quantized ops do not
        if x.dim() == self._dim + 1:
            return super().forward(x.unsqueeze(0)).squeeze(0)
        if x.dim() != self._dim + 2:
            raise InputMismatchError(
                f"int8 {type(self).__name__} takes {self._dim + 2}-D inputs (N, C, {_SPATIAL[self._dim]}) or "
                f"unbatched {self._dim + 1}-D ones, as the float conv does; got shape {tuple(x.shape)}")
        return super().forward(x)

    @classmethod
    def _check_module(cls, mod: nn.Module) -> None:
        if mod.padding_mode != "zeros":
            raise ConstraintViolationError(
                f"{cls.__name__}: padding_mode={mod.padding_mode!r} is not supported by quantized "
                f"conv kernels (zeros only); keep this conv in float",
                field="module.padding_mode", value=mod.padding_mode)

    @classmethod
    def _pack(cls, mod: nn.Module, qweight: torch.Tensor) -> object:
        prepack = getattr(_Q, f"conv{cls._dim}d_prepack")
        return prepack(qweight, _float_bias(mod), list(mod.stride), _conv_padding(mod, cls.__name__),
                       list(mod.dilation), mod.groups)

    @classmethod
    def _select_op(cls, relu: bool) -> Callable[..., torch.Tensor]:
        return getattr(_Q, f"conv{cls._dim}d_relu" if relu else f"conv{cls._dim}d")

    @classmethod
    def _self_test_module(cls) -> tuple[nn.Module, tuple[int, ...]]:
        conv = getattr(nn, f"Conv{cls._dim}d")(4, 6, 3, padding=1, stride=1)
        return conv, (1, 4) + (5,) * cls._dim


class Conv1d(_ConvNd):
    """``nn.Conv1d`` (+ReLU) -> quantized.conv1d / conv1d_relu."""

    _float_type, _dim, _op_flag = nn.Conv1d, 1, "conv1d"


class Conv2d(_ConvNd):
    """``nn.Conv2d`` (+ReLU) -> quantized.conv2d / conv2d_relu."""

    _float_type, _dim = nn.Conv2d, 2


class Conv3d(_ConvNd):
    """``nn.Conv3d`` (+ReLU) -> quantized.conv3d / conv3d_relu."""

    _float_type, _dim, _op_flag = nn.Conv3d, 3, "conv3d"


def _conv_transpose_relu(op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """There is no fused transposed-conv+ReLU op; ReLU on the requantized output is exact."""
    def conv_transpose_relu(x: torch.Tensor, packed: object, scale: float, zero_point: int
                            ) -> torch.Tensor:
        return torch.relu(op(x, packed, scale, zero_point))
    return conv_transpose_relu


class _ConvTransposeNd(_ConvNd):
    """Transposed conv: weight (in, out/groups, *k), so per-channel scales live on axis 1."""

    _channel_axis = 1
    _per_channel_flag = "per_channel_conv_transpose"
    _GEOMETRY = _ConvNd._GEOMETRY + ("output_padding",)

    @classmethod
    def from_context(cls, ctx: KernelContext) -> _PackedWeightKernel:
        mod, _ = split_fused_relu(ctx.module, cls._float_type, cls.__name__)
        if ctx.weight_qparams is not None and ctx.weight_qparams.per_channel and mod.groups != 1:
            raise ConstraintViolationError(
                f"{cls.__name__}: per-channel weights with groups={mod.groups} are not supported "
                f"by quantized transposed conv; use per-tensor weights",
                field="weight_qparams.axis", value=ctx.weight_qparams.axis)
        kernel = super().from_context(ctx)
        cls._probe(kernel, mod, ctx)
        return kernel

    @classmethod
    def _probe(cls, kernel: _PackedWeightKernel, mod: nn.Module, ctx: KernelContext) -> None:
        """Run this layer's kernel once on a small input and refuse it if it misses the float result.

        torch 2.13's fbgemm/x86/oneDNN transposed convs are wrong for some shapes (kernel size 2
        with 8+ channels: outputs off by tens of LSB, a UNet's upsampling at 16 dB instead of 38)
        while the engine-level self-test passes, so the check is per layer; qnnpack is exact.
        """
        in_scale, in_zp, in_dtype = activation_qparams(ctx.input_qparams[0], "input_qparams[0]")
        gen = torch.Generator().manual_seed(0)
        shape = (1, mod.in_channels) + tuple(max(2, k) + 1 for k in mod.kernel_size)
        ints = torch.randint(0, 128, shape, generator=gen).double()
        x = quantize_input(((ints - in_zp) * in_scale).float(), in_scale, in_zp, in_dtype)
        with forward_quiet():
            out = kernel(x)
            qweight, bias = kernel._packed.unpack()
        fn = getattr(torch.nn.functional, f"conv_transpose{cls._dim}d")
        weight = qweight.dequantize().reshape(mod.weight.shape)  # 1d weights are packed as 2d
        expected = fn(x.dequantize(), weight, bias, mod.stride, mod.padding,
                      mod.output_padding, mod.groups, mod.dilation)
        try:
            check_against(out, torch.relu(expected) if kernel._op.__name__ == "conv_transpose_relu"
                          else expected, cls.__name__, kernel.engine)
        except BackendUnavailableError as error:
            raise ConstraintViolationError(
                f"{cls.__name__} {tuple(mod.weight.shape)} kernel_size={mod.kernel_size}: the kernel "
                f"of engine {kernel.engine!r} gives wrong results for this layer ({error})",
                field="engine", value=kernel.engine) from error

    @classmethod
    def _pack(cls, mod: nn.Module, qweight: torch.Tensor) -> object:
        prepack = getattr(_Q, f"conv_transpose{cls._dim}d_prepack")
        return prepack(qweight, _float_bias(mod), list(mod.stride), list(mod.padding),
                       list(mod.output_padding), list(mod.dilation), mod.groups)

    @classmethod
    def _select_op(cls, relu: bool) -> Callable[..., torch.Tensor]:
        op = getattr(_Q, f"conv_transpose{cls._dim}d")
        return _conv_transpose_relu(op) if relu else op

    @classmethod
    def _self_test_module(cls) -> tuple[nn.Module, tuple[int, ...]]:
        conv = getattr(nn, f"ConvTranspose{cls._dim}d")(4, 6, 3, stride=2, padding=1)
        return conv, (1, 4) + (4,) * cls._dim


class ConvTranspose1d(_ConvTransposeNd):
    """``nn.ConvTranspose1d`` -> quantized.conv_transpose1d."""

    _float_type, _dim, _op_flag = nn.ConvTranspose1d, 1, "conv_transpose1d"


class ConvTranspose2d(_ConvTransposeNd):
    """``nn.ConvTranspose2d`` -> quantized.conv_transpose2d."""

    _float_type, _dim, _op_flag = nn.ConvTranspose2d, 2, "conv_transpose2d"


class ConvTranspose3d(_ConvTransposeNd):
    """``nn.ConvTranspose3d`` -> quantized.conv_transpose3d."""

    _float_type, _dim, _op_flag = nn.ConvTranspose3d, 3, "conv_transpose3d"
