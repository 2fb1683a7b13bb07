"""The modules swapped into a model: a weight-only linear, embedding and embedding bag.

Both hold the quantized weight as plain buffers (``qweight`` uint8, ``scales`` float32,
``zero_points`` uint8 when asymmetric), which is what ``qp.save`` and ``state_dict()`` give. The linear
also holds the kernel chosen for it and that kernel's packed form of those buffers (derived data: made
again when a buffer is replaced or written in place, e.g. by ``load_state_dict``), and an optional
per-input-feature ``input_scale`` (AWQ's scales, applied to the activation, so no other layer of the
model has to change).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.errors import ModelStateError
from qplug_core.ir.tracing import refuse_tracing
from qplug_core.kernels.base import SwappedLayer
from qplug_core.kernels.decode_threads import run_within_budget
from qplug_core.kernels.embedding import bag_lookup, fused_rows
from qplug_core.kernels.layer_faults import (
    ExplainedLayer,
    Fault,
    dtype_refusal,
    first_input,
    ids_outside,
    not_ids,
    wrong_dtype,
    wrong_width,
)
from qplug_core.kernels.per_token import version_counter
from qplug_core.kernels.weight_only import ReferenceKernel, WeightOnlyKernel
from qplug_core.kernels.weight_only_scheme import QuantizedWeight, WeightOnlyScheme, unpack
from qplug_core.kernels.weight_view import FloatWeightView


class DerivedPacking:
    """A kernel's packed form of some tensors, made again when one of them is replaced or written
    in place (its version counter moved: ``load_state_dict``, ``bias.add_(...)``), so the model
    computes with the state it shows. Only a cache: copies and pickles are empty and pack on first
    use. Inference tensors have no version counter: only their replacement is seen."""

    def __init__(self) -> None:
        self._state: tuple[tuple, Any] | None = None

    def put(self, sources: tuple[torch.Tensor | None, ...], packed: Any) -> None:
        """Remember ``packed`` as made from ``sources`` as they are now."""
        self._state = (_key(sources), packed)

    def get(self, sources: Callable[[], tuple[torch.Tensor | None, ...]], pack: Callable[[], Any]) -> Any:
        """The packed form of ``sources()``, from ``pack()`` when they changed since it was made."""
        state = self._state
        if state is None or state[0] != _key(sources()):
            packed = pack()  # may replace the sources (a group's members become views of its stack)
            state = self._state = (_key(sources()), packed)
        return state[1]

    def __reduce__(self) -> tuple:
        return (type(self), ())

    def __deepcopy__(self, memo: dict) -> DerivedPacking:
        return type(self)()


def _key(sources: tuple[torch.Tensor | None, ...]) -> tuple:
    return tuple(None if t is None else (id(t), version_counter(t)) for t in sources)


class _QuantizedWeightHolder(ExplainedLayer, SwappedLayer):
    def _store(self, weight: QuantizedWeight) -> None:
        self.scheme = weight.scheme
        self.register_buffer("qweight", weight.data)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zero_points", weight.zero_points)

    def quantized_weight(self) -> QuantizedWeight:
        if self.scales.dtype != torch.float32:  # model.to(torch.bfloat16) / .half() after quantizing
            dtype = self.scales.dtype
            raise ModelStateError(f"this weight-only model was cast to {dtype} after quantizing: its layers' "
                                  f"float32 scales are {dtype} now, and its kernels were chosen for float32 "
                                  f"scales; cast the float model first and quantize that "
                                  f"(qp.quantize_weights(model.to({dtype}), ...) computes in {dtype})")
        return QuantizedWeight(self.scheme, self._shape(), self.qweight, self.scales, self.zero_points)

    def _shape(self) -> tuple[int, int]:
        raise NotImplementedError


class WeightOnlyLinear(_QuantizedWeightHolder):
    """``y = (x * input_scale) @ dequantize(W).T + bias`` through the chosen kernel.

    ``from_transposed`` records that the float module stored its weight ``[in, out]`` (Hugging
    Face's ``Conv1D``), for reports and loading; the quantized weight is always ``[out, in]``.
    """

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None,
                 input_scale: torch.Tensor | None = None, *, from_transposed: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.from_transposed = from_transposed
        self._store(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("input_scale", input_scale)
        self.kernel: WeightOnlyKernel = ReferenceKernel()
        self.packing = DerivedPacking()
        #: (the :class:`~qplug_core.weight_only.fusion.FusedLinears` computing this layer, its part)
        self.fused: tuple[Any, int] | None = None

    def _shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def use_kernel(self, kernel: WeightOnlyKernel, packed: Any) -> None:
        """Run through ``kernel`` with its ``packed`` weight (from the selection, already checked), on
        its own: out of a group it was joined to."""
        self.kernel, self.fused = kernel, None
        self.packing.put(self.weight_tensors(), packed)

    def join(self, group: Any, index: int) -> None:
        """Run as part ``index`` of ``group``'s kernel call (a
        :class:`~qplug_core.weight_only.fusion.FusedLinears`); the layer's own packed weight goes."""
        self.kernel, self.packing, self.fused = group.kernel, DerivedPacking(), (group, index)

    #: the dtype its float layer computed in, the only one that layer took (set with its kernel:
    #: :func:`~qplug_core.weight_only.api.choose_kernels`); None: not known, not checked
    activation_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype is not self.activation_dtype and self.activation_dtype is not None
                and not torch.is_autocast_enabled("cpu")):  # under autocast the float layer takes it too
            # kernels cast (ONNX Runtime's to float32) or compute in the input's dtype (the reference)
            self.quantized_weight()  # but a model cast after quantizing says that first (ModelStateError)
            raise dtype_refusal(f"weight-only kernel {self.kernel.name!r}", x, self.activation_dtype)
        if self.kernel.runs_outside_torch and (torch.jit.is_tracing() or torch.compiler.is_exporting()):
            # before packing, which builds the runtime's copy from the (fake, under export) weights
            refuse_tracing(f"weight-only kernel {self.kernel.name}", (x,))
        if self.fused is not None:
            group, index = self.fused
            return group.output(index, x)
        packed = self.packing.get(self.weight_tensors, lambda: self.kernel.pack(self.quantized_weight()))
        return run_linear(self.kernel, packed, x, self.bias, self.input_scale, self.out_features, self.scheme)

    def input_fault(self, args: tuple, kwargs: dict) -> Fault | None:
        x = first_input(args, kwargs, "x")
        if self.activation_dtype is not None and not torch.is_autocast_enabled("cpu") \
                and wrong_dtype(x, self.activation_dtype):
            return wrong_dtype(x, self.activation_dtype)
        fault = wrong_width(x, self.in_features)
        if fault is None and isinstance(x, torch.Tensor):
            reason = self.kernel.supports(self.scheme, self._shape(), x.dtype)
            if reason:  # the float layer refuses another dtype than its weight's too
                return RuntimeError, f"runs kernel {self.kernel.name!r}, which cannot take this input: {reason}"
        return fault

    @property
    def weight(self) -> FloatWeightView:
        """The dequantized weight ``[out, in]`` for model code that reads it (T5 checks its dtype in
        every forward): dtype, shape and device cost nothing, its values are made when an op reads them
        and not kept (:mod:`~qplug_core.kernels.weight_view`). Writing to it raises ModelStateError."""
        return FloatWeightView(lambda: self.quantized_weight().dequantize(), self._shape(), self.qweight.device)

    def weight_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The buffers its packed weight is made from."""
        return self.qweight, self.scales, self.zero_points

    def extra_repr(self) -> str:
        scheme = self.scheme
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={scheme.bits}, "
                f"group_size={scheme.group_size}, symmetric={scheme.symmetric}, kernel={self.kernel.name}")


def run_linear(kernel: WeightOnlyKernel, packed: Any, x: torch.Tensor, bias: torch.Tensor | None,
               input_scale: torch.Tensor | None, out_features: int, scheme: WeightOnlyScheme) -> torch.Tensor:
    """``(x * input_scale) @ W.T + bias`` through ``kernel`` for any leading shape of ``x``
    (``out_features`` x its last dimension, quantized as ``scheme``)."""
    if input_scale is not None:
        x = x * input_scale
    leading = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    # in a decode step on one thread, the kernel may take the step's other threads
    key = (kernel.name, scheme.bits, scheme.group_size, scheme.symmetric, out_features, rows.shape[1], rows.shape[0])
    y = run_within_budget(key, lambda: kernel.run(packed, rows, bias))
    return y.reshape(*leading, out_features)


class WeightOnlyEmbedding(_QuantizedWeightHolder):
    """An embedding whose table is quantized per row (groups along the embedding dimension);
    only the looked-up rows are dequantized."""

    def __init__(self, weight: QuantizedWeight, padding_idx: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx
        self._store(weight)

    def _shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scheme, k = self.scheme, self.embedding_dim
        groups = self.scales.shape[1]
        # F.embedding refuses ids < 0 and >= num_embeddings as nn.Embedding does (indexing wrapped -1
        # to the last row)
        q = unpack(F.embedding(ids, self.qweight), scheme.bits, k).to(torch.int16)
        scales = F.embedding(ids, self.scales)
        if self.zero_points is None:
            zp: Any = scheme.midpoint
        else:
            zp = F.embedding(ids, self.zero_points).to(torch.int16)[..., None]
        q = q.view(*ids.shape, groups, k // groups)
        return ((q - zp).to(scales.dtype) * scales[..., None]).view(*ids.shape, k)

    #: what nn.Embedding raises for an id outside its table (nn.EmbeddingBag: RuntimeError)
    _OUTSIDE: type[Exception] = IndexError

    def input_fault(self, args: tuple, kwargs: dict) -> Fault | None:
        ids = first_input(args, kwargs, "ids")
        return not_ids(ids) or ids_outside(ids, self.num_embeddings, self._OUTSIDE)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, bits={self.scheme.bits}, "
                f"group_size={self.scheme.group_size}, symmetric={self.scheme.symmetric}")


class WeightOnlyEmbeddingBag(WeightOnlyEmbedding):
    """An ``nn.EmbeddingBag`` over a quantized table. Sum and mean bags over one scale per row run
    torch's fused 8-bit / 4-bit bag op on a copy of the table in its layout
    (:func:`~qplug_core.kernels.embedding.fused_rows`: the looked-up rows are never made float);
    other bags dequantize their entries' rows and run torch's own bag reduction over them. Either
    way offsets, ``per_sample_weights`` and ``padding_idx`` mean what they mean in ``nn.EmbeddingBag``."""

    _OUTSIDE = RuntimeError

    def __init__(self, weight: QuantizedWeight, mode: str, include_last_offset: bool = False,
                 padding_idx: int | None = None):
        super().__init__(weight, padding_idx)
        self.mode, self.include_last_offset = mode, include_last_offset
        self.packing = DerivedPacking()

    def fused_table(self) -> torch.Tensor | None:
        """The table in the fused op's layout, or ``None`` where that op does not compute this bag
        (mode max, groups within a row, a table off the CPU or cast from float32, ...) or a trace
        records the computation (it stays plain torch)."""
        if (self.mode == "max" or self.qweight.device.type != "cpu" or self.scales.dtype != torch.float32
                or torch.jit.is_tracing() or torch.compiler.is_compiling()):
            return None
        return self.packing.get(lambda: (self.qweight, self.scales, self.zero_points),
                                lambda: fused_rows(self.quantized_weight(), self.padding_idx))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        table = self.fused_table()
        if table is not None:
            return bag_lookup(table, self.scheme.bits, self.mode, self.include_last_offset, self.padding_idx,
                              ids, offsets, per_sample_weights)
        rows = super().forward(ids.reshape(-1))
        entries = torch.arange(ids.numel(), device=ids.device).view(ids.shape)
        padding = None
        if self.padding_idx is not None:  # padding entries point at an extra row, torch's padding row
            padding = ids.numel()
            rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
            entries = torch.where(ids == self.padding_idx, padding, entries)
        return F.embedding_bag(entries, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
                               include_last_offset=self.include_last_offset, padding_idx=padding)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"
