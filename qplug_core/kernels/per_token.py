"""Dynamic int8 linear with one activation scale per token and one weight scale per channel.

Per-tensor dynamic activations share one scale across every token of a batch, so one token with
an outlier (trained transformers have them in the residual stream and the FFN output) costs every
other token its resolution. Here each row of the input gets its own asymmetric 8-bit grid,
weights get a symmetric scale per output channel, and the 8-bit product accumulates in int32 in
oneDNN's packed linear (uint8 activations; it also applies the weight scales), else in
``torch._int_mm`` (plain int8 tensors either way: no quantized dtypes). Two passes over the output
remain: the zero point's share, removed with precomputed weight column sums, and the token scales
with the bias.

The GEMM follows the CPU (:func:`qplug_core.kernels.cpu.cpu_int8`): oneDNN's packed linear with
VNNI, and also on AVX2 CPUs without it, where it sums pairs of u8 x s8 products in int16 with
saturation, so its weights there get the 7-bit range that keeps every pair within int16
(``qplug_core.kernels.arithmetic``). ``torch._int_mm`` runs generic code on CPUs without VNNI,
slower than fp32, so that choice warns.

On real all-MiniLM-L6-v2 weights this keeps the sentence-embedding cosine at 0.998+ where
per-tensor dynamic gets 0.994 (docs/guide/accuracy.md has the figures and the command).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from qplug_core.errors import ConfigValidationError, ModelStateError, warn_user
from qplug_core.ir.tracing import refuse_tracing, run_eagerly
from qplug_core.kernels.arithmetic import Int8Arithmetic, pair_sums_saturate, safe_weight_range
from qplug_core.kernels.base import SwappedLayer
from qplug_core.kernels.cpu import CpuInt8, cpu_int8
from qplug_core.kernels.decode_threads import run_with_fastest_threads
from qplug_core.kernels.layer_faults import (
    ExplainedLayer,
    Fault,
    dtype_refusal,
    first_input,
    wrong_dtype,
    wrong_width,
)
from qplug_core.kernels.weight_view import FloatWeightView

__all__ = ["PER_TOKEN_LAYERS", "QMAX", "PerTokenDynamicLinear", "SharedInput", "best_gemm", "onednn_is_exact",
           "onednn_usable", "per_token_is_fast", "per_token_quantize", "swap_in_per_token",
           "symmetric_per_channel_int8", "weight_qmax"]

#: key of a saved model's document listing the float linears that run per-token dynamic
PER_TOKEN_LAYERS = "per_token"

QMAX = 127  # symmetric [-127, 127]: -128 is never produced, so negation is exact
_EPS = torch.finfo(torch.float32).eps


#: steps of a token's grid: two fewer than a byte has, so that rounding the ends of [min, max]
#: (half a step out at worst) never leaves the byte and no clamp pass is needed
LEVELS = 253
#: 1.5 * 2**23: adding it to a float32 within +-2**22 rounds it to the nearest integer (ties to
#: even), held in the low mantissa bits, whose low byte is the integer modulo 256
_ROUNDING = 12582912.0


@torch.no_grad()
def _quantize(x: torch.Tensor, unsigned: bool, scratch: threading.local | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 or int8 tensor, scale, zero point) per token, in three passes over ``x`` after the
    two reductions: scale and shift with the rounding constant, then read the low byte.

    With ``scratch`` the float work and the integer result go to buffers kept there (the next
    call overwrites them): in a whole model, fresh buffers of a few MB each cost page faults
    whenever the allocator has handed memory back to the system (MiniLM, 8 x 128 tokens: 22k ->
    15k faults and ~6% of the time per batch here). They keep the largest input seen, per thread."""
    # two vectorized reductions: torch.aminmax over the last dim is ~10x slower on CPU
    low = x.amin(dim=-1, keepdim=True).clamp_max_(0)
    high = x.amax(dim=-1, keepdim=True).clamp_min_(0)
    scale = (high - low).clamp_min_(_EPS).div_(LEVELS)
    inverse = scale.reciprocal()
    # the lowest level 1 (uint8) or -127 (int8): [min, max] lands in [0.5, 254.5] (or 128 less)
    zero_point = torch.mul(low, inverse).round_().neg_().add_(1.0 if unsigned else -127.0)
    # mul then add_, not addcmul: addcmul broadcasting its [..., 1] first operand is ~4x slower
    if scratch is None:
        work, q = torch.mul(x, inverse), torch.empty(x.shape, dtype=torch.uint8)
    else:
        work = torch.mul(x, inverse, out=_buffer(scratch, "work", x.shape, torch.float32))
        q = _buffer(scratch, "codes", x.shape, torch.uint8)
    work.add_(zero_point + _ROUNDING)
    q.copy_(work.view(torch.int32))  # int32 -> uint8 keeps the low byte (modulo 256)
    return (q if unsigned else q.view(torch.int8)), scale, zero_point


def _quantize_token(x: torch.Tensor, unsigned: bool, scratch: threading.local | None = None
                    ) -> tuple[torch.Tensor, float, int]:
    """:func:`_quantize` of one token (``x.numel()`` is the feature count), with the scale and
    zero point as Python numbers: one reduction and three elementwise ops instead of sixteen ops,
    ~11 us instead of ~44 (1024 features, Zen 4). A decode step calls this once per linear input,
    where the tensor code's small ops cost about as much as the GEMM. The scale is computed in
    float64 (the tensor code rounds it to float32), so a code can differ from :func:`_quantize`'s
    by one only where ``x / scale`` falls within float32 rounding of a tie."""
    if x.requires_grad:  # the out= ops below refuse autograd inputs; codes carry no gradient
        x = x.detach()
    flat = x.reshape(-1)
    low_t, high_t = torch.aminmax(flat)
    low, high = min(low_t.item(), 0.0), max(high_t.item(), 0.0)
    scale = max(high - low, _EPS) / LEVELS
    inverse = 1.0 / scale
    zero_point = -round(low * inverse) + (1 if unsigned else -127)
    if scratch is None:
        work, q = torch.mul(flat, inverse), torch.empty(flat.shape, dtype=torch.uint8)
    else:
        work, q = _token_buffers(scratch, flat.numel())
        torch.mul(flat, inverse, out=work)
    work.add_(zero_point + _ROUNDING)
    q.copy_(work.view(torch.int32))
    return (q if unsigned else q.view(torch.int8)), scale, zero_point


def _token_buffers(scratch: threading.local, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 work, uint8 codes) buffers of ``numel`` elements kept in ``scratch``, one pair per
    size (a model's linears read a few feature counts)."""
    buffers = getattr(scratch, "token_buffers", None)
    if buffers is None:
        buffers = scratch.token_buffers = {}
    pair = buffers.get(numel)
    if pair is None:
        pair = buffers[numel] = (_reusable_empty((numel,), torch.float32),
                                 _reusable_empty((numel,), torch.uint8))
    return pair


def _buffer(scratch: threading.local, name: str, shape: torch.Size, dtype: torch.dtype
            ) -> torch.Tensor:
    """A ``shape`` tensor in the largest buffer ``scratch.<name>`` has held so far."""
    numel = shape.numel()
    buffer = getattr(scratch, name, None)
    if buffer is None or buffer.numel() < numel:
        buffer = _reusable_empty((numel,), dtype)
        setattr(scratch, name, buffer)
    return buffer[:numel].view(shape)


def _reusable_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer that later calls may write in place inside or outside ``torch.inference_mode()``
    (one made inside it is an inference tensor, which cannot be written outside it)."""
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype)


@torch.no_grad()
def per_token_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 tensor, scale ``[..., 1]``, zero point ``[..., 1]``) per token (last dimension).

    Asymmetric: each token's [min, max] (with 0) maps onto :data:`LEVELS` steps of int8
    (``x ~ (q - zero_point) * scale``). Activations after GELU or ReLU are nearly one-sided, so
    a symmetric grid would waste half its levels on them: on MiniLM this takes the embedding
    cosine from 0.9973 (symmetric) to 0.9989.
    """
    if x.dtype != torch.float32:
        raise ConfigValidationError(f"per_token_quantize takes float32, got {x.dtype}",
                                    field="x", value=x.dtype)
    return _quantize(x, unsigned=False)


class PerThread(threading.local):
    """Per-thread scratch state that copies and pickles as empty (it is only a cache)."""

    def __reduce__(self) -> tuple:
        return (type(self), ())

    def __deepcopy__(self, memo: dict) -> PerThread:
        return type(self)()


class _PackedWeight:
    """oneDNN's packed copy of a weight, remade when the weight buffer changes; copies and pickles
    as empty (the opaque packed tensor can do neither, and is only derived data)."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.packed: torch.Tensor | None = None
        self.zero_points: torch.Tensor | None = None

    def get(self, weight_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (weight_t.data_ptr(), version_counter(weight_t))
        packed, zero_points = self.packed, self.zero_points
        if self.key != key or packed is None or zero_points is None:
            packed = torch.ops.onednn.qlinear_prepack(weight_t.t().contiguous(), None)
            zero_points = torch.zeros(weight_t.shape[1], dtype=torch.long)
            self.packed, self.zero_points, self.key = packed, zero_points, key
        return packed, zero_points

    def __reduce__(self) -> tuple:
        return (type(self), ())

    def __deepcopy__(self, memo: dict) -> _PackedWeight:
        return type(self)()


def version_counter(x: torch.Tensor) -> int | None:
    """``x._version``, or None for an inference tensor (made under ``torch.inference_mode()``),
    which has no version counter: it cannot say whether it changed in place."""
    return None if x.is_inference() else x._version


class SharedInput:
    """The last input quantized by any of a model's per-token linears, reused while unchanged.

    Attention's query, key and value projections read the same tensor; quantizing it once
    instead of three times saves a third of the per-token overhead. A hit needs the very same
    tensor object at the same version counter (no in-place change since), quantized to the same
    integer type; inference tensors have no version counter, so they are quantized every time. The
    cache is per thread, so one model can serve several threads; the integer
    tensor it returns lives in a per-thread buffer that the next quantization overwrites.
    """

    def __init__(self) -> None:
        self._local = PerThread()

    def quantize(self, x: torch.Tensor, unsigned: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._cached(x, (unsigned, False), lambda state: _quantize(x, unsigned, scratch=state))

    def quantize_token(self, x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
        """:func:`_quantize_token` (uint8 codes) of a one-token ``x``, cached the same way."""
        return self._cached(x, (True, True), lambda state: _quantize_token(x, True, scratch=state))

    def _cached(self, x: torch.Tensor, kind: tuple[bool, bool], compute: Any) -> Any:
        state = self._local
        source = state.source() if getattr(state, "source", None) is not None else None
        version = version_counter(x)
        if source is x and version is not None and version == state.version and state.kind == kind:
            return state.quantized
        state.quantized = compute(state)
        state.source, state.version, state.kind = weakref.ref(x), version, kind
        return state.quantized


def symmetric_per_channel_int8(weight: torch.Tensor, qmax: int = QMAX
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float scale per output channel) with the symmetric [-qmax, qmax] grid."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(_EPS) / qmax
    return torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8), scale


#: the arguments of torch 2.13's ``onednn::qlinear_pointwise``, as this module calls it
_ONEDNN_ARGUMENTS = ("qx", "x_scale", "x_zero_point", "qw", "w_scale", "w_zero_point", "bias",
                     "output_scale", "output_zero_point", "output_dtype", "post_op_name",
                     "post_op_args", "post_op_algorithm")
GEMMS = ("onednn", "int_mm")


#: oneDNN's x86 int8 kernels: vpmaddubsw pair sums without VNNI
ONEDNN_ARITHMETIC = Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI


@functools.cache
def _onednn_linear_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        schema = torch.ops.onednn.qlinear_pointwise.default._schema
    except (AttributeError, RuntimeError):
        return False
    return tuple(a.name for a in schema.arguments) == _ONEDNN_ARGUMENTS


def onednn_usable(cpu: CpuInt8 | None = None) -> bool:
    """oneDNN's uint8 x int8 linear runs here fast and exactly: torch has it with the op signature
    this module binds, and the CPU has VNNI, AMX or AVX2 (then with 7-bit weights,
    :func:`weight_qmax`); without AVX2 it runs reference code."""
    cpu = cpu_int8() if cpu is None else cpu
    return (cpu.vnni or cpu.amx or cpu.avx2) and _onednn_linear_available()


def best_gemm(cpu: CpuInt8 | None = None) -> str:
    """The fastest exact int8 GEMM on this machine: oneDNN's packed linear (it also applies the
    weight scales, saving two passes over the output) where it computes the worst case exactly
    with :func:`weight_qmax`'s weights, else ``torch._int_mm``."""
    if onednn_usable(cpu) and onednn_is_exact(weight_qmax("onednn", cpu)):
        return "onednn"
    return "int_mm"


def per_token_is_fast(cpu: CpuInt8 | None = None) -> bool:
    """Whether per-token dynamic beats fp32 here: its GEMM is oneDNN's (exactly: VNNI, AMX, or AVX2
    with 7-bit weights); ``torch._int_mm`` without VNNI is 25-30x slower than fp32. Accuracy
    targets offer the per-token rung on this ground, and ``qplug doctor`` says so."""
    return best_gemm(cpu) == "onednn"


@functools.cache
def onednn_is_exact(qmax: int) -> bool:
    """Run once per process: oneDNN's linear on the worst case for int16 pair sums (u8 codes of
    255 against weights of +-``qmax``) equals the exact product. The flags say which instructions
    the CPU has; this says what the installed kernels do with them."""
    k, n = 64, 4
    weight = torch.full((n, k), qmax, dtype=torch.int8)
    weight[1::2] = -qmax
    codes = torch.full((2, k), 255, dtype=torch.uint8)
    exact = codes.double() @ weight.double().t()
    try:
        packed = torch.ops.onednn.qlinear_prepack(weight, None)
        out = torch.ops.onednn.qlinear_pointwise(codes, 1.0, 0, packed, torch.ones(n),
                                                 torch.zeros(n, dtype=torch.long), None, 1.0, 0,
                                                 torch.float32, "none", [], "")
    except RuntimeError:
        return False
    return torch.equal(out.double(), exact)


def weight_qmax(gemm: str, cpu: CpuInt8 | None = None) -> int:
    """The largest weight integer ``gemm`` takes exactly on ``cpu``: 127, or 64 where oneDNN sums
    u8 x s8 pairs in int16 (2 x 255 x 64 = 32,640 fits; 2 x 255 x 127 does not)."""
    if gemm == "onednn" and pair_sums_saturate(ONEDNN_ARITHMETIC, cpu):
        return safe_weight_range((-QMAX, QMAX), 255)[1]
    return QMAX


def _warn_if_slower_than_float(gemm: str) -> None:
    cpu = cpu_int8()
    if gemm == "int_mm" and not (cpu.vnni or cpu.amx or cpu.arm_dot):
        warn_user(f"per-token dynamic int8 runs torch._int_mm here ({cpu.summary()}), which has no "
                  "fast int8 path on this CPU and is slower than fp32 (about 30x measured on AVX2): "
                  "keep these layers float, or use per-tensor dynamic (per_token=False)")


class PerTokenDynamicLinear(ExplainedLayer, SwappedLayer):
    """``nn.Linear`` computed as int8 x int8 -> int32 with per-token and per-channel scales.

    ``gemm`` picks the integer product: ``"onednn"`` (uint8 activations, packed weights) or
    ``"int_mm"`` (``torch._int_mm``, int8 activations); None takes :func:`best_gemm`. Both are
    exact, so they agree to float rounding. ``simulate=True`` does the same arithmetic with float
    matmuls (the reference backend, and the oracle the int8 paths are tested against).
    """

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, *, simulate: bool = False,
                 shared: SharedInput | None = None, gemm: str | None = None) -> None:
        super().__init__()
        if gemm is not None and gemm not in GEMMS:
            raise ConfigValidationError(f"gemm must be one of {', '.join(GEMMS)} or None, got "
                                        f"{gemm!r}", field="gemm", value=gemm)
        if gemm == "onednn" and not onednn_usable():
            raise ConfigValidationError(
                "gemm='onednn' needs torch built with oneDNN and a CPU with AVX2, VNNI or AMX, which "
                "this machine lacks; use gemm='int_mm' or None (the best available)", field="gemm",
                value=gemm)
        if gemm == "onednn" and not simulate and not onednn_is_exact(weight_qmax(gemm)):
            raise ConfigValidationError(
                f"gemm='onednn' saturates int16 pair sums on this CPU ({cpu_int8().summary()}) "
                "even with the weights this CPU's flags call safe; use gemm=None (the best exact "
                "GEMM here)", field="gemm", value=gemm)
        gemm = gemm or best_gemm()
        if not simulate:
            _warn_if_slower_than_float(gemm)
        qmax = QMAX if simulate else weight_qmax(gemm)
        if weight_int8.numel() and int(weight_int8.to(torch.int16).abs().max()) > qmax:
            # the CPU's kernels cannot take these integers exactly: requantize to the safe range
            weight_int8, weight_scale = symmetric_per_channel_int8(
                weight_int8.float() * weight_scale.float()[:, None], qmax)
        self.in_features, self.out_features = weight_int8.shape[1], weight_int8.shape[0]
        self.register_buffer("weight_int8_t", weight_int8.t().contiguous())  # [K, N] for _int_mm
        self.register_buffer("weight_scale", weight_scale.float())
        # sum over k of w[k, n] * weight_scale[n]: removes the activation zero point's share
        self.register_buffer("column_sums", weight_int8.float().sum(1) * weight_scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.simulate = simulate
        self.shared = shared
        self.gemm = gemm
        # one token at a time (decode) on oneDNN: the short path (per-token activations only)
        self._token_path = not simulate and gemm == "onednn" and not self.one_input_scale
        self._scratch = PerThread()  # int32 accumulator per thread, reused while shapes repeat
        self._packed = _PackedWeight()

    @classmethod
    def from_float(cls, linear: nn.Module, *, simulate: bool = False,
                   shared: SharedInput | None = None, gemm: str | None = None
                   ) -> PerTokenDynamicLinear:
        if not isinstance(linear, nn.Linear):
            raise ConfigValidationError(f"PerTokenDynamicLinear converts nn.Linear, got "
                                        f"{type(linear).__name__}", field="module")
        gemm = gemm or best_gemm()
        weight, scale = symmetric_per_channel_int8(linear.weight,
                                                   QMAX if simulate else weight_qmax(gemm))
        return cls(weight, scale, linear.bias, simulate=simulate, shared=shared, gemm=gemm)

    def input_fault(self, args: tuple, kwargs: dict) -> Fault | None:
        x = first_input(args, kwargs, "x")
        return wrong_dtype(x, torch.float32) or wrong_width(x, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing() or torch.compiler.is_compiling():
            refuse_tracing(type(self).__name__, (x,), "it reuses per-thread buffers and packed weights "
                                                      "found by data pointer")
            return _opaque_forward(self, x)  # torch.compile: inductor failed inside (empty AssertionError)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale.dtype != torch.float32:  # model.to(torch.bfloat16) / .half() after quantizing
            raise ModelStateError(f"this int8 model was cast to {self.weight_scale.dtype} after quantizing: its "
                                  "int8 linears compute in float32 and take float32 scales; quantize the float32 "
                                  "model again and keep it float32")
        if x.dtype is not torch.float32:  # as the float32 nn.Linear it replaced, which computed in float32
            raise dtype_refusal("int8 per-token linear", x, torch.float32)
        if self._token_path and x.numel() == self.in_features:
            return self._one_token(x)
        unsigned = not self.simulate and self.gemm == "onednn"
        q, scale, zero_point = self._quantized_input(x, unsigned)
        if unsigned and (scale.numel() == 1 or self.one_input_scale):
            # one scale and zero point for every row (a decode step's single token, or static
            # activations): oneDNN applies them and the bias itself, no pass over the output left
            packed, zero_points = self._packed.get(self.weight_int8_t)
            out = torch.ops.onednn.qlinear_pointwise(
                q.reshape(-1, self.in_features), float(scale.reshape(-1)[0]), int(zero_point.reshape(-1)[0]),
                packed, self.weight_scale, zero_points, self.bias, 1.0, 0, torch.float32, "none", [], "")
            return out.reshape(*x.shape[:-1], self.out_features)
        out = self._weight_scaled_products(q.reshape(-1, self.in_features))
        # (q - zp) W s_w s_x + b: the zero-point term as one rank-1 update, then one pass for both
        # the token scales and the bias
        out.addr_(zero_point.reshape(-1), self.column_sums, alpha=-1.0)
        scale = scale.reshape(-1, 1)
        if self.bias is not None:
            torch.addcmul(self.bias, out, scale, out=out)
        else:
            out.mul_(scale)
        return out.reshape(*x.shape[:-1], self.out_features)

    #: whether every row of an input shares one scale (static activations)
    one_input_scale = False

    @property
    def weight(self) -> FloatWeightView:
        """The weight the kernel uses, as a float tensor whose values are made only when an op reads
        them (:mod:`~qplug_core.kernels.weight_view`).

        Model code reads ``self.wo.weight`` (T5's feed-forward checks its dtype on every call),
        as ``DynamicLinear`` keeps one: without it a per-token T5 raised AttributeError at its
        first forward. Writing to it raises ModelStateError."""
        return FloatWeightView(lambda: self.weight_int8_t.t().float() * self.weight_scale[:, None],
                               (self.out_features, self.in_features), self.weight_scale.device)

    def _one_token(self, x: torch.Tensor) -> torch.Tensor:
        """A decode step's single token through oneDNN with Python-number qparams and the bias:
        one scale and zero point, so nothing is left to do on the output; on one thread where
        that measured faster (:mod:`~qplug_core.kernels.decode_threads`)."""
        q, scale, zero_point = (self.shared.quantize_token(x) if self.shared is not None
                                else _quantize_token(x, True, self._scratch))
        packed, zero_points = self._packed.get(self.weight_int8_t)
        out = run_with_fastest_threads(
            ("onednn-one-token", self.in_features, self.out_features),
            lambda: torch.ops.onednn.qlinear_pointwise(
                q.view(1, self.in_features), scale, zero_point, packed, self.weight_scale, zero_points,
                self.bias, 1.0, 0, torch.float32, "none", [], ""))
        return out.view(*x.shape[:-1], self.out_features)

    def _quantized_input(self, x: torch.Tensor, unsigned: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(integer codes, scale, zero point), the scales broadcasting over the last dimension."""
        return self.shared.quantize(x, unsigned) if self.shared is not None else _quantize(x, unsigned)

    def _weight_scaled_products(self, q: torch.Tensor) -> torch.Tensor:
        """``(q @ W) * weight_scale`` as float32 ``[tokens, out_features]``, q still unshifted."""
        if self.simulate:
            return (q.double() @ self.weight_int8_t.double()).float().mul_(self.weight_scale)
        if self.gemm == "onednn":
            packed, zero_points = self._packed.get(self.weight_int8_t)
            return torch.ops.onednn.qlinear_pointwise(
                q, 1.0, 0, packed, self.weight_scale, zero_points, None, 1.0, 0, torch.float32,
                "none", [], "")
        acc = getattr(self._scratch, "acc", None)
        if acc is None or acc.shape[0] != q.shape[0]:
            acc = self._scratch.acc = _reusable_empty((q.shape[0], self.out_features), torch.int32)
        torch._int_mm(q, self.weight_int8_t, out=acc)
        return acc.float().mul_(self.weight_scale)  # int32 * float is a slow unvectorized path

    def extra_repr(self) -> str:
        kind = "simulated" if self.simulate else self.gemm
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {kind}")


@run_eagerly
def _opaque_forward(layer: PerTokenDynamicLinear, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward run eagerly under torch.compile (a graph break around it)."""
    return layer._forward(x)


def swap_in_per_token(gm: nn.Module, layers: list[str], *, simulate: bool,
                      saved: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> list[str]:
    """Replace the float ``nn.Linear`` modules ``layers`` of a converted model (or the linear
    inside a fused ``LinearReLU``) by per-token dynamic ones sharing one input cache, so that
    q/k/v quantize their common input once; returns the names replaced. A layer in ``saved`` takes
    those (int8 weight, per-channel scales) as a file holds them, the others quantize their float
    weight. A name that is not a float linear raises :class:`ConfigValidationError`."""
    from qplug_core.nn.intrinsic import FusedModule

    shared, replaced = SharedInput(), []
    for name in layers:
        try:
            module = gm.get_submodule(name)
        except AttributeError as error:
            raise ConfigValidationError(f"no module {name!r} to run per-token dynamic",
                                        field="layers", value=name) from error
        fused = isinstance(module, FusedModule) and len(module) and type(module[0]) is nn.Linear
        linear = module[0] if fused else module  # LinearReLU: its linear, then its ReLU
        if type(linear) is not nn.Linear:
            raise ConfigValidationError(f"{name!r} is a {type(linear).__name__}, not a float "
                                        "nn.Linear: it cannot run per-token dynamic",
                                        field="layers", value=name)
        if saved is not None and name in saved:
            per_token = PerTokenDynamicLinear(*saved[name], linear.bias, simulate=simulate, shared=shared)
        else:
            per_token = PerTokenDynamicLinear.from_float(linear, simulate=simulate, shared=shared)
        gm.set_submodule(name, _with_first_child(module, per_token) if fused else per_token)
        replaced.append(f"{name}.0" if fused else name)
    return replaced


def _with_first_child(fused: nn.Sequential, first: nn.Module) -> nn.Sequential:
    """A new container of ``fused``'s type holding ``first`` and ``fused``'s other children.

    The container is replaced, not changed: the converted model shares its float modules with its
    reference snapshot, which ``qp.save`` encodes and ``qp.export_onnx`` rebuilds from. It is made
    past ``FusedModule``'s child type check, which guards fusion (float children only)."""
    container = nn.Sequential.__new__(type(fused))
    nn.Sequential.__init__(container, first, *list(fused)[1:])
    container.train(fused.training)
    return container
