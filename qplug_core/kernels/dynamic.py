"""Dynamic (weight-only ahead of time) kernels: Linear, LSTM, GRU and the RNN cells.

Weights are quantized once (qint8, per-tensor or per-channel symmetric, or float16) and packed under
the target engine; activations are quantized per call inside the ops, so these modules take and
return float tensors. Whether activations take 7 bits (``reduce_range``) is the flows' choice (the
calibrated activation range); a direct caller gets the CPU's: 7 bits where the engine's kernels
sum u8 x s8 pairs in int16 (x86 without VNNI, ``kernels/arithmetic.py``), full 8 bits elsewhere
(VNNI, qnnpack, which ignores the flag and complains).
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from qplug_core.errors import ConfigValidationError, ConstraintViolationError, InputMismatchError
from qplug_core.ir.qdq_ops import refuse_nonfinite_input
from qplug_core.ir.tracing import refuse_export
from qplug_core.kernels._common import (
    check_reduction_length,
    forward_quiet,
    quantize_weight,
    split_fused_relu,
    wrong_input_size,
)
from qplug_core.kernels.arithmetic import engine_arithmetic, pair_sums_saturate
from qplug_core.kernels.base import PackedHolder, PackedStateModule, engine_context, quiet_quantized_dtypes
from qplug_core.kernels.capabilities import engine_capabilities
from qplug_core.kernels.layer_faults import (
    ExplainedLayer,
    Fault,
    dtype_refusal,
    first_input,
    wrong_dtype,
    wrong_rank,
    wrong_width,
)
from qplug_core.kernels.reference import dynamic_weight_names
from qplug_core.kernels.weight_view import FloatWeightView
from qplug_core.qparams import QParams

_Q = torch.ops.quantized
_WEIGHT_DTYPES = (torch.qint8, torch.float16)


def symmetric_weight_qparams(weight: torch.Tensor, per_channel: bool) -> QParams:
    """qint8 symmetric min/max qparams (torch's default dynamic weight observer: amax / 127.5)."""
    w = weight.detach().float()
    amax = w.abs().flatten(1).amax(1) if per_channel else w.abs().max()
    scale = torch.clamp(amax / 127.5, min=torch.finfo(torch.float32).eps)
    return QParams(scale, torch.zeros_like(scale, dtype=torch.int64), torch.qint8, -128, 127,
                   axis=0 if per_channel else None, is_dynamic=True)


def _check_kernel_input(x: torch.Tensor, kernel: str) -> None:
    """The ops quantize float32 only (another dtype met "Quantize only works on Float Tensor"), and
    over the input's own range, which NaN or Inf does not have: one sum finds them (~7 us a call).
    torch.export is refused: its fake tensors cannot run the packed weights (an LSTM's, held in a
    list, get here; a linear's own packed attribute fails in torch before the forward runs)."""
    refuse_export(f"the dynamic int8 layer {kernel}", (x,))
    if x.dtype is not torch.float32:
        raise dtype_refusal(f"int8 {kernel}", x, torch.float32)
    refuse_nonfinite_input(x, f"int8 {kernel}", x.detach().sum())


class IntegerWeight(NamedTuple):
    """One int8 weight matrix as plain tensors: what ``qp.save`` writes of a dynamic layer."""

    int8: torch.Tensor
    scales: torch.Tensor  # float64, one per output channel or one
    zero_points: torch.Tensor  # int64, shaped like scales
    per_channel: bool

    def dequantized(self) -> torch.Tensor:
        """The float weight on its int8 grid: quantizing it with :meth:`qparams` gives ``int8`` back."""
        shape = (-1, 1) if self.per_channel else ()
        return (self.int8.double() - self.zero_points.reshape(shape)) * self.scales.reshape(shape)

    @property
    def shape(self) -> torch.Size:
        return self.int8.shape

    def qparams(self) -> QParams:
        return QParams(self.scales, self.zero_points, torch.qint8, -128, 127,
                       axis=0 if self.per_channel else None, is_dynamic=True)


class HalfWeight(NamedTuple):
    """One float16 weight matrix, exactly as packed: what ``qp.save`` writes of a float16 layer."""

    half: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.half.shape

    def dequantized(self) -> torch.Tensor:
        """The float weight: packing it for float16 gives ``half`` back."""
        return self.half.float()


#: a dynamic layer's weight matrix as plain tensors (``qp.save`` / ``from_stored``)
StoredWeight = IntegerWeight | HalfWeight


def unpack_stored(packed: object, dtype: torch.dtype) -> tuple[StoredWeight, torch.Tensor | None]:
    """The weight matrix of a packed qint8 or float16 linear weight, and its float bias."""
    with quiet_quantized_dtypes():
        if dtype == torch.float16:
            weight, bias = _Q.linear_unpack_fp16(packed)
            return HalfWeight(weight.half()), bias
        weight, bias = _Q.linear_unpack(packed)
        if weight.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            return IntegerWeight(weight.int_repr(), weight.q_per_channel_scales().double(),
                                 weight.q_per_channel_zero_points().long(), True), bias
        return IntegerWeight(weight.int_repr(), torch.tensor(weight.q_scale(), dtype=torch.float64),
                             torch.tensor(weight.q_zero_point(), dtype=torch.long), False), bias


class DynamicKernel(ExplainedLayer, PackedStateModule):
    """Shared ``from_float`` checks and weight packing of the dynamic modules."""

    _float_type: type[nn.Module] | tuple[type[nn.Module], ...]

    def __init__(self, dtype: torch.dtype, engine: str, reduce_range: bool):
        super().__init__()
        self.dtype, self.engine, self.reduce_range = dtype, engine, reduce_range

    @classmethod
    def _check(cls, dtype: torch.dtype, engine: str, per_channel: bool) -> None:
        name, caps = cls.__name__, engine_capabilities(engine)
        if dtype not in _WEIGHT_DTYPES:
            raise ConfigValidationError(f"{name}: dtype must be torch.qint8 or torch.float16, got "
                                        f"{dtype}", field="dtype", value=dtype)
        if dtype == torch.float16 and not caps.fp16_dynamic_linear:
            raise ConstraintViolationError(
                f"{name}: engine {engine!r} on torch {torch.__version__} cannot pack float16 "
                f"weights; use dtype=torch.qint8", field="dtype", value=dtype)
        if per_channel and dtype == torch.qint8 and not caps.per_channel_linear:
            raise ConstraintViolationError(
                f"{name}: engine {engine!r} lacks per-channel linear weights; use per_channel=False",
                field="per_channel", value=per_channel)

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None, per_channel: bool,
              qparams: QParams | None) -> object:
        """Pack one weight matrix (call under ``engine_context``); ``qparams`` default to symmetric."""
        check_reduction_length(weight.shape[1], type(self).__name__)
        bias = None if bias is None else bias.detach().float()
        if self.dtype == torch.float16:
            return _Q.linear_prepack_fp16(weight.detach().float(), bias)
        if qparams is None:
            qparams = symmetric_weight_qparams(weight, per_channel)
        return _Q.linear_prepack(quantize_weight(weight, qparams), bias)

    @classmethod
    def from_float(cls, mod: nn.Module, *, dtype: torch.dtype = torch.qint8,
                   engine: str | None = None, per_channel: bool = False,
                   reduce_range: bool | None = None,
                   weight_qparams: QParams | Mapping[str, QParams] | None = None) -> DynamicKernel:
        """Quantize and pack ``mod``'s weights for ``engine`` (default: the current engine).

        ``reduce_range=None`` picks 7-bit activations where ``engine``'s kernels sum pairs in
        int16 on this CPU (x86 without VNNI; ``override_cpu_flags`` decides as another CPU
        would); the flows pass the calibrated choice. ``weight_qparams`` override the default symmetric weight
        qparams, so a user's weight observer is honoured: a ``QParams`` for a linear, one per weight
        matrix by parameter name for recurrent layers and cells (``{"weight_ih_l0": ..., ...}``);
        a matrix not named keeps the default.
        """
        engine = engine or torch.backends.quantized.engine
        cls._check(dtype, engine, per_channel)
        if reduce_range is None:
            reduce_range = pair_sums_saturate(engine_arithmetic(engine))
        given: dict[str, QParams] = (
            {"weight": weight_qparams} if isinstance(weight_qparams, QParams) else dict(weight_qparams or {}))
        unknown = sorted(set(given) - set(dynamic_weight_names(mod)))
        if unknown:
            raise ConfigValidationError(
                f"{cls.__name__}: weight_qparams names {unknown}, which {type(mod).__name__} does not "
                f"have; its weight matrices: {dynamic_weight_names(mod)} (a recurrent layer takes one "
                "QParams per matrix, by name)", field="weight_qparams", value=unknown)
        kernel = cls(dtype, engine, reduce_range=reduce_range)
        with engine_context(engine):
            kernel._build(mod, per_channel, given)
        return kernel

    def _build(self, mod: nn.Module, per_channel: bool, weight_qparams: dict[str, QParams]) -> None:
        raise NotImplementedError

    @classmethod
    def _from_stored(cls, mod: nn.Module, weights: Mapping[str, tuple[StoredWeight, torch.Tensor | None]], *,
                     engine: str, reduce_range: bool) -> DynamicKernel:
        """The kernel whose stored weights are ``weights`` (by ``mod``'s weight names, with the bias
        packed beside each), packed again from ``mod`` once they are its weights and biases: the
        integers, scales and float16 values are reproduced exactly."""
        with torch.no_grad():
            for name, (weight, bias) in weights.items():
                getattr(mod, name).copy_(weight.dequantized())
                if bias is not None:
                    getattr(mod, name.replace("weight", "bias", 1)).copy_(bias)
        integer = {name: weight for name, (weight, _) in weights.items() if isinstance(weight, IntegerWeight)}
        return cls.from_float(mod, dtype=torch.qint8 if integer else torch.float16, engine=engine,
                              per_channel=any(weight.per_channel for weight in integer.values()),
                              reduce_range=reduce_range,
                              weight_qparams={name: weight.qparams() for name, weight in integer.items()})

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, engine={self.engine!r}, reduce_range={self.reduce_range}"


class DynamicLinear(DynamicKernel):
    """``nn.Linear`` (+ReLU) with int8 or fp16 weights; float in, float out."""

    def _build(self, mod: nn.Module, per_channel: bool, weight_qparams: dict[str, QParams]) -> None:
        linear, relu = split_fused_relu(mod, nn.Linear, type(self).__name__)
        self._in_features, self._out_features = linear.in_features, linear.out_features
        self._packed = self._pack(linear.weight, linear.bias, per_channel, weight_qparams.get("weight"))
        if self.dtype == torch.float16:
            self._op: Callable[[torch.Tensor], torch.Tensor] = (
                _Q.linear_relu_dynamic_fp16 if relu else _Q.linear_dynamic_fp16)
        else:
            op, reduce_range = (_Q.linear_relu_dynamic if relu else _Q.linear_dynamic), self.reduce_range
            self._op = lambda x, packed: op(x, packed, reduce_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_kernel_input(x, type(self).__name__)
        if x.dim() == 0 or x.shape[-1] != self._in_features:  # qnnpack answers a wrong width
            raise wrong_input_size(type(self).__name__, self._in_features, "feature", "last dimension",
                                   tuple(x.shape))
        with forward_quiet():
            if x.dim() == 1:  # nn.Linear takes one vector; the ops take batches only
                return self._op(x.unsqueeze(0), self._packed).squeeze(0)
            return self._op(x, self._packed)

    def input_fault(self, args: tuple, kwargs: dict) -> Fault | None:
        x = first_input(args, kwargs, "x")
        return wrong_dtype(x, torch.float32) or wrong_width(x, self._in_features)

    def _unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(float weight on its int8 / float16 grid, float bias), unpacked at each read: a float copy
        kept beside the packed weight would more than double the layer's memory."""
        with quiet_quantized_dtypes():
            if self.dtype == torch.float16:
                weight, bias = _Q.linear_unpack_fp16(self._packed)
            else:
                weight, bias = _Q.linear_unpack(self._packed)
                weight = weight.dequantize()
        return weight.float(), None if bias is None else bias.float()

    def stored_weight(self) -> StoredWeight:
        """The weight ``[out, in]`` as plain tensors (int8 with its scales, or float16): what
        ``qp.save`` writes and :meth:`from_stored` rebuilds the same kernel from."""
        return unpack_stored(self._packed, self.dtype)[0]

    @classmethod
    def from_stored(cls, weight: StoredWeight, bias: torch.Tensor | None, *, engine: str,
                    reduce_range: bool) -> DynamicLinear:
        """The kernel :meth:`stored_weight` came from."""
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        kernel = cls._from_stored(linear, {"weight": (weight, bias)}, engine=engine, reduce_range=reduce_range)
        return kernel  # type: ignore[return-value]

    @property
    def weight(self) -> torch.Tensor:
        """The weight the kernel uses, as a float view (writing to it raises ModelStateError).

        Model code reads ``self.linear.weight`` (T5 checks its dtype, ``nn.TransformerEncoderLayer``
        its device), so a converted layer must keep one. A view, not a tensor: reading its dtype
        unpacks nothing, and torch's encoder fast path declines it, so the layer runs this kernel
        rather than float math on dequantized weights.
        """
        return FloatWeightView(lambda: self._unpacked()[0], (self._out_features, self._in_features),
                               torch.device("cpu"))

    @property
    def bias(self) -> torch.Tensor | None:
        """The float bias, unpacked once per packed weight (the encoder fast path reads it per call)."""
        packed, bias = self.__dict__.get("_bias_of", (None, None))
        if packed is not self._packed:
            bias = self._unpacked()[1]
            self.__dict__["_bias_of"] = (self._packed, bias)
        return bias

    @property
    def in_features(self) -> int:
        return self._in_features

    @property
    def out_features(self) -> int:
        return self._out_features


def _bias(mod: nn.Module, name: str, size: int) -> torch.Tensor:
    """The cell ops need bias tensors; a bias-free layer gets zeros (same numbers)."""
    b = getattr(mod, name, None)
    return torch.zeros(size) if b is None else b.detach().float()


class _DynamicRecurrent(DynamicKernel):
    """A recurrent layer or cell: packed weight matrices kept by the float module's names, and the
    float module's options, which a saved kernel records (``qp.load`` checks the model's against
    them)."""

    _float_type: type[nn.Module]
    _packed_by_name: dict[str, object]
    #: the float module's constructor options that shape the kernel
    OPTIONS: tuple[str, ...]

    def stored_weights(self) -> dict[str, tuple[StoredWeight, torch.Tensor | None]]:
        """Each weight matrix and the float bias packed with it, by the float module's names
        (``weight_ih_l0``: ...; a bias-free LSTM / GRU's biases are zeros, a bias-free cell's
        None): what ``qp.save`` writes and :meth:`from_stored` rebuilds the same kernel from."""
        return {name: unpack_stored(packed, self.dtype) for name, packed in self._packed_by_name.items()}

    @classmethod
    def from_stored(cls, options: Mapping[str, int | bool | str],
                    weights: Mapping[str, tuple[StoredWeight, torch.Tensor | None]], *, engine: str,
                    reduce_range: bool) -> _DynamicRecurrent:
        """The kernel :meth:`stored_weights` came from, for a float module of ``options``
        (:data:`OPTIONS`)."""
        kernel = cls._from_stored(cls._float_type(**options), weights, engine=engine, reduce_range=reduce_range)
        return kernel  # type: ignore[return-value]


class _DynamicRNN(_DynamicRecurrent):
    """Stacked, optionally bidirectional LSTM/GRU over ``torch.quantized_lstm`` / ``_gru``.

    Takes every input ``nn.LSTM`` / ``nn.GRU`` take (batched, unbatched 2-D, ``PackedSequence``), in
    the forms the ops take (batched, or a packed sequence's data and batch sizes). The ops check no
    shape (qnnpack answered an unbatched input with a wrongly shaped output), so every one is checked
    here, by ``nn.LSTM``'s rules.
    """

    #: what ``hx`` holds, in order: (h0, c0) for an LSTM, h0 for a GRU
    _state_names: tuple[str, ...]

    def _build(self, mod: nn.Module, per_channel: bool, weight_qparams: dict[str, QParams]) -> None:
        if not isinstance(mod, self._float_type):
            raise ConfigValidationError(f"{type(self).__name__}: expected {self._float_type}, got "
                                        f"{type(mod).__name__}", field="module")
        if getattr(mod, "proj_size", 0):
            raise ConstraintViolationError(f"{type(self).__name__}: proj_size is not supported by "
                                           f"torch.quantized_lstm", field="proj_size")
        self.num_layers, self.hidden_size, self.input_size = mod.num_layers, mod.hidden_size, mod.input_size
        self.bidirectional, self.batch_first = mod.bidirectional, mod.batch_first
        params, self._packed_by_name = [], {}
        for layer in range(mod.num_layers):
            for suffix in ("", "_reverse")[: 2 if mod.bidirectional else 1]:
                names = [f"{kind}_{part}_l{layer}{suffix}" for kind in ("weight", "bias")
                         for part in ("ih", "hh")]
                w_ih, w_hh = getattr(mod, names[0]), getattr(mod, names[1])
                b_ih, b_hh = (_bias(mod, n, w_ih.shape[0]) for n in names[2:])
                p_ih = self._pack(w_ih, b_ih, per_channel, weight_qparams.get(names[0]))
                p_hh = self._pack(w_hh, b_hh, per_channel, weight_qparams.get(names[1]))
                self._packed_by_name.update({names[0]: p_ih, names[1]: p_hh})
                if self.dtype == torch.float16:
                    params.append(_Q.make_quantized_cell_params_fp16(p_ih, p_hh))
                else:
                    params.append(_Q.make_quantized_cell_params_dynamic(p_ih, p_hh, b_ih, b_hh,
                                                                        self.reduce_range))
        self._cells = nn.ModuleList(PackedHolder(param) for param in params)

    @property
    def _params(self) -> list[object]:
        return [cell.param for cell in self._cells]

    OPTIONS = ("input_size", "hidden_size", "num_layers", "bidirectional", "batch_first")

    def _recur(self, data: torch.Tensor, batch_sizes: torch.Tensor | None, states: tuple[torch.Tensor, ...]
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The op on a batched input (``batch_sizes`` None) or a packed sequence's data."""
        raise NotImplementedError

    def _run(self, x: torch.Tensor | PackedSequence, hx: tuple[torch.Tensor, ...] | None
             ) -> tuple[torch.Tensor | PackedSequence, tuple[torch.Tensor, ...]]:
        """(output, final states) as ``nn.LSTM`` / ``nn.GRU`` give them for ``x`` and ``hx``."""
        if isinstance(x, PackedSequence):
            self._check_input(x.data, packed=True)
            states = _permuted(self._states(hx, int(x.batch_sizes[0]), x.data, batched=True), x.sorted_indices)
            out, states = self._recur(x.data, x.batch_sizes, states)
            return (PackedSequence(out, x.batch_sizes, x.sorted_indices, x.unsorted_indices),
                    _permuted(states, x.unsorted_indices))
        self._check_input(x, packed=False)
        batched, batch_dim = x.dim() == 3, 0 if self.batch_first else 1
        states = self._states(hx, x.shape[batch_dim] if batched else 1, x, batched)
        if not batched:  # as nn.LSTM: a batch of one, then squeezed out of every result
            x = x.unsqueeze(batch_dim)
        out, states = self._recur(x, None, states)
        if batched:
            return out, states
        return out.squeeze(batch_dim), tuple(state.squeeze(1) for state in states)

    def input_fault(self, args: tuple, kwargs: dict) -> Fault | None:
        x = first_input(args, kwargs, "x")
        data = x.data if isinstance(x, PackedSequence) else x
        # nn.LSTM / nn.GRU check the dtype and the rank first, in Python (ValueError), then the width
        return (wrong_dtype(data, torch.float32, ValueError) or wrong_rank(x, (2, 3))
                or wrong_width(data, self.input_size))

    def _check_input(self, data: torch.Tensor, packed: bool) -> None:
        """Refuse ``data`` (a tensor input, or a PackedSequence's data) unless it is float32, 3-D or 2-D
        (packed: 2-D) and ``input_size`` wide."""
        kernel = type(self).__name__
        _check_kernel_input(data, kernel)
        if data.dim() not in ((2,) if packed else (2, 3)) or data.shape[-1] != self.input_size:
            batched = "(batch, seq, {0})" if self.batch_first else "(seq, batch, {0})"
            got = f"a PackedSequence whose data has shape {tuple(data.shape)}" if packed else f"shape {tuple(data.shape)}"
            raise InputMismatchError(
                f"int8 {kernel} takes a {batched.format(self.input_size)} input, an unbatched "
                f"(seq, {self.input_size}) one or a PackedSequence of (steps, {self.input_size}) data, got "
                f"{got}: the model's inputs do not have the shape it was quantized for")

    def _states(self, hx: tuple[torch.Tensor, ...] | None, batch: int, x: torch.Tensor, batched: bool
                ) -> tuple[torch.Tensor, ...]:
        """The batched initial states: ``hx`` once checked (zeros for None, as ``nn.LSTM``)."""
        layers = self.num_layers * (2 if self.bidirectional else 1)
        if hx is None:
            return tuple(torch.zeros(layers, batch, self.hidden_size, dtype=x.dtype, device=x.device)
                         for _ in self._state_names)
        expected = (layers, batch, self.hidden_size) if batched else (layers, self.hidden_size)
        for name, state in zip(self._state_names, hx):
            if tuple(state.shape) != expected:
                raise InputMismatchError(
                    f"int8 {type(self).__name__}: {name} has shape {tuple(state.shape)}, but an input of "
                    f"{'' if batched else 'unbatched '}shape {tuple(x.shape)} takes {expected} (layers x "
                    "directions, batch, hidden_size; no batch dimension for an unbatched input)")
        return hx if batched else tuple(state.unsqueeze(1) for state in hx)


def _permuted(states: tuple[torch.Tensor, ...], order: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """States reordered along the batch (a PackedSequence runs its sequences longest first)."""
    return states if order is None else tuple(state.index_select(1, order) for state in states)


class DynamicLSTM(_DynamicRNN):
    """``nn.LSTM``: ``forward(x, (h0, c0)=None) -> (out, (h, c))``."""

    _float_type = nn.LSTM
    _state_names = ("h0", "c0")

    def forward(self, x: torch.Tensor | PackedSequence, hx: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor | PackedSequence, tuple[torch.Tensor, torch.Tensor]]:
        out, (h, c) = self._run(x, hx)
        return out, (h, c)

    def _recur(self, data: torch.Tensor, batch_sizes: torch.Tensor | None, states: tuple[torch.Tensor, ...]
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        with forward_quiet():
            if batch_sizes is None:
                out, h, c = torch.quantized_lstm(data, states, self._params, True, self.num_layers, 0.0, False,
                                                 self.bidirectional, self.batch_first, dtype=self.dtype,
                                                 use_dynamic=True)
            else:
                out, h, c = torch.quantized_lstm(data, batch_sizes, states, self._params, True, self.num_layers,
                                                 0.0, False, self.bidirectional, dtype=self.dtype,
                                                 use_dynamic=True)
        return out, (h, c)


class DynamicGRU(_DynamicRNN):
    """``nn.GRU``: ``forward(x, h0=None) -> (out, h)``."""

    _float_type = nn.GRU
    _state_names = ("h0",)

    def forward(self, x: torch.Tensor | PackedSequence, hx: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | PackedSequence, torch.Tensor]:
        out, (h,) = self._run(x, None if hx is None else (hx,))
        return out, h

    def _recur(self, data: torch.Tensor, batch_sizes: torch.Tensor | None, states: tuple[torch.Tensor, ...]
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        with forward_quiet():
            if batch_sizes is None:
                out, h = torch.quantized_gru(data, states[0], self._params, True, self.num_layers, 0.0, False,
                                             self.bidirectional, self.batch_first)
            else:
                out, h = torch.quantized_gru(data, batch_sizes, states[0], self._params, True, self.num_layers,
                                             0.0, False, self.bidirectional)
        return out, (h,)


def unbatched_cell_call(step: Callable, x: torch.Tensor, hx):
    """``step(x, hx)`` on a batch; a 1-D ``x`` (and its 1-D states) run as a batch of one and come
    back 1-D, as ``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.RNNCell`` answer unbatched inputs."""
    if x.dim() != 1:
        return step(x, hx)
    if hx is not None:
        hx = tuple(h.unsqueeze(0) for h in hx) if isinstance(hx, tuple) else hx.unsqueeze(0)
    out = step(x.unsqueeze(0), hx)
    return tuple(o.squeeze(0) for o in out) if isinstance(out, tuple) else out.squeeze(0)


class _DynamicCell(_DynamicRecurrent):
    """One recurrent cell: two dynamic linears (ih, hh) and the float gate maths.

    torch's ``quantized_*_cell_dynamic`` ops hard-code ``reduce_range=True``, which makes qnnpack
    print an unsuppressible C++ warning to stderr; composing the cell from ``linear_dynamic``
    calls keeps the per-engine ``reduce_range`` and the same numbers.
    """

    def _build(self, mod: nn.Module, per_channel: bool, weight_qparams: dict[str, QParams]) -> None:
        if not isinstance(mod, self._float_type):
            raise ConfigValidationError(f"{type(self).__name__}: expected {self._float_type}, got "
                                        f"{type(mod).__name__}", field="module")
        self.hidden_size, self.input_size, self.bias = mod.hidden_size, mod.input_size, mod.bias
        self._packed_by_name = {name: self._pack(getattr(mod, name), getattr(mod, name.replace("weight", "bias")),
                                                 per_channel, weight_qparams.get(name))
                                for name in ("weight_ih", "weight_hh")}
        self._holders = nn.ModuleDict({name: PackedHolder(packed) for name, packed in self._packed_by_name.items()})

    def forward(self, x: torch.Tensor, hx=None):
        """What the float cell takes: a batch ``(N, input_size)`` or one unbatched ``(input_size,)``
        input, with states shaped alike (the ops take batches only)."""
        _check_kernel_input(x, type(self).__name__)
        if x.dim() not in (1, 2) or x.shape[-1] != self.input_size:
            raise wrong_input_size(type(self).__name__, self.input_size, "feature",
                                   "a 2-D batch or one 1-D input", tuple(x.shape))
        return unbatched_cell_call(self._step, x, hx)

    OPTIONS = ("input_size", "hidden_size", "bias")

    def input_fault(self, args: tuple, kwargs: dict) -> Fault | None:
        x = first_input(args, kwargs, "x")
        return wrong_dtype(x, torch.float32) or wrong_rank(x, (1, 2)) or wrong_width(x, self.input_size)

    def stored_weights(self) -> dict[str, tuple[StoredWeight, torch.Tensor | None]]:
        weights = super().stored_weights()  # a bias-free cell packed None, which qnnpack unpacks as zeros
        return weights if self.bias else {name: (weight, None) for name, (weight, _) in weights.items()}

    def _step(self, x: torch.Tensor, hx):
        raise NotImplementedError

    def _linear(self, x: torch.Tensor, packed: object) -> torch.Tensor:
        with forward_quiet():
            if self.dtype == torch.float16:
                return _Q.linear_dynamic_fp16(x, packed)
            return _Q.linear_dynamic(x, packed, self.reduce_range)

    def _gates(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._linear(x, self._holders["weight_ih"].param), self._linear(h, self._holders["weight_hh"].param)

    def _zeros(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0], self.hidden_size, dtype=x.dtype)


class LSTMCell(_DynamicCell):
    """``nn.LSTMCell``: ``forward(x, (h, c)=None) -> (h', c')``."""

    _float_type = nn.LSTMCell

    def _step(self, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        h, c = (self._zeros(x), self._zeros(x)) if hx is None else hx
        gi, gh = self._gates(x, h)
        i, f, g, o = (gi + gh).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


class GRUCell(_DynamicCell):
    """``nn.GRUCell``: ``forward(x, h=None) -> h'``."""

    _float_type = nn.GRUCell

    def _step(self, x: torch.Tensor, hx: torch.Tensor | None) -> torch.Tensor:
        h = self._zeros(x) if hx is None else hx
        (i_r, i_z, i_n), (h_r, h_z, h_n) = (g.chunk(3, 1) for g in self._gates(x, h))
        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h


class RNNCell(_DynamicCell):
    """``nn.RNNCell`` (tanh or relu): ``forward(x, h=None) -> h'``."""

    _float_type = nn.RNNCell
    OPTIONS = ("input_size", "hidden_size", "bias", "nonlinearity")

    def _build(self, mod: nn.Module, per_channel: bool, weight_qparams: dict[str, QParams]) -> None:
        super()._build(mod, per_channel, weight_qparams)
        self.nonlinearity = mod.nonlinearity

    def _step(self, x: torch.Tensor, hx: torch.Tensor | None) -> torch.Tensor:
        gi, gh = self._gates(x, self._zeros(x) if hx is None else hx)
        return torch.relu(gi + gh) if self.nonlinearity == "relu" else torch.tanh(gi + gh)
