"""ONNX Runtime's ``com.microsoft.MatMulNBits`` as a qplug weight-only kernel.

``MatMulNBits`` multiplies float activations by 4- or 8-bit weights quantized in blocks along K,
with ``accuracy_level=4`` (activations rounded to int8 per block, integer dot products in MLAS),
which on AVX2 and AVX-512 CPUs is the fastest weight-only path measured (docs: field notes).
qplug's layout is already ``MatMulNBits``'s (unsigned values, two 4-bit values per byte, even
feature in the low nibble, ``[N, blocks, bytes per block]``), so packing builds a one-node model
whose initializers are those tensors. The session is built for the thread count in use
(``torch.get_num_threads()`` at call time): one for one thread, one for the latest count above.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch

from qplug_core.plugin_api import QuantizedWeight, WeightOnlyKernel

from qplug_onnxruntime.session import native_run

#: block sizes MatMulNBits takes (a power of two, at least 16)
BLOCK_SIZES = (16, 32, 64, 128, 256)
#: the block a per-channel weight (one scale per row) runs in, its scale repeated in every block:
#: the same dequantized weight, so qp.quantize_weights(bits=8)'s default scheme gets this kernel.
#: accuracy_level=4 rounds the activations to int8 per block, so the block sets their precision:
#: 32 keeps real all-MiniLM-L6-v2 at cosine 0.9994 (mean; 0.9989 with 128, below the 0.999 its
#: reference kernel's 0.9996 allows) for 1.16x the decode time of 128 on a 4096x4096 layer
#: (Intel Xeon, AVX-512 VNNI, 1 thread)
PER_CHANNEL_BLOCKS = (32, 16)
ACCURACY_LEVEL = 4
_OUTPUTS = ["Y"]


class MatMulNBitsKernel(WeightOnlyKernel):
    """``y = x @ dequantize(W).T + b`` in an ORT session holding one ``MatMulNBits`` node."""

    runs_outside_torch = True

    name = "onnxruntime-matmulnbits"

    def supports(self, scheme, shape, activation_dtype):
        if activation_dtype != torch.float32:
            return f"float32 activations only, not {activation_dtype}"
        if block_size(scheme, shape[1]) is None:
            if scheme.group_size is None:
                return f"per-channel weights need in_features a multiple of 16, not {shape[1]}"
            return f"block (group) size one of {BLOCK_SIZES}, not {scheme.group_size}"
        return None

    def pack(self, weight: QuantizedWeight) -> _Sessions:
        sessions = _Sessions(weight)
        sessions.session()  # built now, so a weight ORT refuses fails the selection's check
        return sessions

    def run(self, packed, x, bias):
        # ~0.03 ms of ORT for a 1024 x 1024 layer at decode: every microsecond around it counts
        if x.requires_grad:
            x = x.detach()
        if x.dtype != torch.float32:  # the caller's autocast (its layer refuses other dtypes otherwise)
            x = x.float()
        y = torch.from_numpy(packed.runner()(_OUTPUTS, {"A": x.contiguous().numpy()})[0])
        return y if bias is None else y + bias


class _Sessions:
    """The sessions of one weight: one for one thread and one for the latest count above it. The
    weight is the module's own (no copy); the serialized model exists only while a session is
    built. A session holds its own packed copy of the weight (~1.3x the int8/int4 bytes with
    ``accuracy_level=4``, plus ~1.4 MiB of its own) and a thread pool, so a change between two
    counts above one replaces the session instead of adding one. One thread keeps its own: a
    decoder's decode steps run there while its prompts run on torch's count
    (``qplug_core.weight_only.decode_step``), and rebuilding a layer's session at each switch
    (19 ms for 2816 x 1024 int8) cost 0.5 s per switch on a 4-layer Llama."""

    def __init__(self, weight: QuantizedWeight):
        self.weight = weight
        self._sessions: dict[int, Any] = {}
        self._runners: dict[int, Callable[[list[str], dict], list]] = {}  # their native runs
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> _Sessions:
        """A copy of the model holds the copied weight and builds sessions of its own when first
        called: an ORT session can be neither copied nor pickled."""
        return _Sessions(copy.deepcopy(self.weight, memo))

    def __reduce__(self) -> tuple:
        return (_Sessions, (self.weight,))

    def session(self):
        """The session for the thread count in use."""
        threads = torch.get_num_threads()
        found = self._sessions.get(threads)
        if found is None:
            with self._lock:
                found = self._sessions.get(threads)
                if found is None:
                    found = self._build(threads)
                    kept = [count for count in self._sessions if (count == 1) != (threads == 1)]
                    # a call holding a dropped one finishes with it
                    self._runners = {**{c: self._runners[c] for c in kept}, threads: native_run(found)}
                    self._sessions = {**{c: self._sessions[c] for c in kept}, threads: found}
        return found

    def runner(self) -> Callable[[list[str], dict], list]:
        """The native ``run`` of :meth:`session` (without the Python wrapper's checks)."""
        run = self._runners.get(torch.get_num_threads())
        if run is None:
            self.session()
            run = self._runners[torch.get_num_threads()]
        return run

    def _build(self, threads: int):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # the thread pool must not spin between calls: torch runs the rest of the model meanwhile
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(_model_bytes(self.weight), options, providers=["CPUExecutionProvider"])
        # ORT's Python wrapper keeps the serialized model (here: the whole weight) to rebuild the
        # session on a provider change, which this kernel never asks for (its own comment in
        # onnxruntime 1.32: "holding the memory indefinitely"); kept, every layer's weight stayed
        # in memory a third time, beside the module's and ORT's packed copy
        if getattr(session, "_model_bytes", None) is not None:
            session._model_bytes = None
        return session


def block_size(scheme: Any, in_features: int) -> int | None:
    """The MatMulNBits block of a scheme: its group, or for one scale per output channel the
    first of :data:`PER_CHANNEL_BLOCKS` dividing the row; ``None`` if none fits."""
    if scheme.group_size is not None:
        return scheme.group_size if scheme.group_size in BLOCK_SIZES else None
    return next((b for b in PER_CHANNEL_BLOCKS if in_features % b == 0), None)


def _model_bytes(weight: QuantizedWeight) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    n, k = weight.shape
    bits, block = weight.scheme.bits, block_size(weight.scheme, k)
    blocks = k // block
    data = weight.data.reshape(n, blocks, block * bits // 8).numpy()
    repeat = blocks // weight.scales.shape[1]  # 1, or a per-channel weight's blocks per row
    scales = weight.scales.float().repeat_interleave(repeat, dim=1)
    initializers = [numpy_helper.from_array(data, "B"), numpy_helper.from_array(scales.reshape(-1).numpy(), "S")]
    inputs = ["A", "B", "S"]
    if weight.zero_points is not None:
        zero_points = weight.zero_points.repeat_interleave(repeat, dim=1)
        initializers.append(numpy_helper.from_array(_packed_zero_points(zero_points, bits), "Z"))
        inputs.append("Z")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=ACCURACY_LEVEL)
    graph = helper.make_graph(
        [node], "matmul_nbits",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def _packed_zero_points(zp: torch.Tensor, bits: int):
    """Zero points ``[N, blocks]`` as MatMulNBits wants them: per row, two 4-bit values per byte
    (rows padded)."""
    if bits == 4:
        if zp.shape[1] % 2:
            zp = torch.nn.functional.pad(zp, (0, 1))
        zp = zp[:, 0::2] | (zp[:, 1::2] << 4)
    return zp.contiguous().reshape(-1).numpy()
