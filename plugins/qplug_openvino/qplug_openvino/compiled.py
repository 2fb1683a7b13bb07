"""One compiled partition: an OpenVINO ``CompiledModel`` for the CPU, called with torch tensors.

The ONNX QDQ model of the partition is compiled once (at convert, and again by ``qp.load``) with
the settings in force (:func:`configure`; threads default to ``torch.get_num_threads()``). The
inference precision is pinned to f32: on CPUs with bf16 (AVX512_BF16, AMX) OpenVINO's default
would run the float ops between the int8 ones in bf16, away from the reference form. Inputs are
shared with OpenVINO (no copy); outputs are copied out of the request's buffers, which the next
call overwrites. Each call takes an idle infer request of the compiled model, or creates one when
all are busy, so calls from several threads run at once (one request per concurrent caller,
kept for the next). The partition is exported with every axis its graph leaves free symbolic
(dynamic in OpenVINO), so one compiled model serves every batch size and sequence or time
length >= 2; an input its shapes do not take (size 1 on a symbolic axis, another size on a fixed
one) gets a model compiled for it, kept among the partition's ``shape_cache_size`` least
recently used. At the first call with a new shape OpenVINO's CPU plugin JIT-compiles oneDNN
kernels for it (a small TCN: ~8 ms of CPU per new length, against ~0.7-1 s for a compile); a
static model would run a seen shape faster (plugins/qplug_openvino/README.md has the figures).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from qplug_core.plugin_api import (
    CompiledPartition,
    ConfigValidationError,
    QplugError,
    check_cache_size,
    replaced_settings,
    warn_user,
)

from qplug_openvino.runtime import import_openvino


@dataclass(frozen=True)
class CompileSettings:
    """How partitions are compiled: ``num_threads`` (None: ``torch.get_num_threads()`` at
    compile time) and ``shape_cache_size`` (models a partition keeps for shapes its graph
    fixes, least recently used first out)."""

    num_threads: int | None = None
    shape_cache_size: int = 8
    #: features per run-time activation scale of a dynamic linear (int8 weights into a float
    #: MatMul); 0 leaves its input float (weights dequantized in the kernel). Real
    #: all-MiniLM-L6-v2 with 32 of its linears dynamic, 8x128 tokens, 1 thread, Intel Xeon with
    #: AMX: 0 169 ms, 32 125 ms, 128 104 ms, 384 103 ms, embedding cosine 0.9995 for all four
    dynamic_quantization_group_size: int = 128

    def __post_init__(self) -> None:
        if self.num_threads is not None and (not isinstance(self.num_threads, int)
                                             or isinstance(self.num_threads, bool) or self.num_threads < 1):
            raise ConfigValidationError(f"num_threads must be a positive int or None, got "
                                        f"{self.num_threads!r}", field="num_threads", value=self.num_threads)
        size = self.dynamic_quantization_group_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigValidationError(f"dynamic_quantization_group_size must be an int >= 0, got {size!r}",
                                        field="dynamic_quantization_group_size", value=size)
        check_cache_size(self.shape_cache_size)

    def resolved(self) -> CompileSettings:
        return dataclasses.replace(self, num_threads=self.num_threads or torch.get_num_threads())

    def properties(self) -> dict[str, Any]:
        """OpenVINO CPU properties: one stream, latency, f32 between the int8 ops, dynamic
        linears' inputs quantized per group."""
        return {"INFERENCE_NUM_THREADS": self.num_threads or torch.get_num_threads(),
                "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32",
                "DYNAMIC_QUANTIZATION_GROUP_SIZE": self.dynamic_quantization_group_size}


_settings = CompileSettings()
_lock = threading.Lock()


def settings() -> CompileSettings:
    """The settings new partitions are compiled with."""
    return _settings


def configure(**changes: Any) -> CompileSettings:
    """Change the settings for partitions compiled from now on (convert, load); returns the
    previous ones, so ``configure(**dataclasses.asdict(previous))`` restores them."""
    global _settings
    with _lock:
        previous = _settings
        _settings = replaced_settings(_settings, changes, "qplug_openvino.configure")
    return previous


@dataclass
class _Compiled:
    """The compiled model of one or more input signatures, its idle infer requests, the input
    shapes it takes, and which of the partition's inputs the model reads (OpenVINO drops the
    parameters nothing uses)."""

    model: Any
    positions: list[int]
    outputs: int
    #: the ONNX model's input types and shapes (``plugin_api.onnx_input_shapes``)
    shapes: Any
    #: ``openvino.Tensor``, looked up once
    tensor: Any
    #: the model's int8 constants (:func:`_int8_constants`)
    int8: list[torch.Tensor]
    #: (request, its native infer) not running: a caller takes one, or makes one if none is idle
    idle: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def request(self) -> tuple[Any, Callable[[], Any]]:
        try:
            return self.idle.get_nowait()
        except queue.Empty:
            request = self.model.create_infer_request()
            return request, _native_infer(request)


def _native_infer(request: Any) -> Callable[[], Any]:
    """``request``'s native ``infer`` on the input tensors already set, its outputs left in the
    request's buffers: the Python ``InferRequest.infer`` dispatches its (absent) inputs and wraps
    the results in a dict, ~2 us of a small CNN's call at batch 1 (AMD EPYC Zen 4)."""
    native_module = getattr(import_openvino(), "_pyopenvino", None)
    native = getattr(getattr(native_module, "InferRequest", None), "infer", None)
    if native is None:  # pragma: no cover - an OpenVINO that moved its native request
        return request.infer
    no_inputs: dict = {}
    return lambda: native(request, no_inputs, True, True)  # share_outputs: copied by run, once


def _input_positions(ports: list, names: tuple[str, ...]) -> list[int]:
    """The position among the ONNX model's inputs ``names`` of each compiled input port. A port
    has every name of the tensors OpenVINO merged into it, and ``get_any_name()`` may be another
    one: at batch 1 the class token's ``expand`` to the batch is a no-op, removed, and the port
    reads ``{'expand', 'vit_embeddings_cls_token'}``. Inputs nothing reads are dropped (no port);
    where no name matches, all inputs kept keep the ONNX model's order."""
    positions = [[i for i, name in enumerate(names) if name in port.get_names()] for port in ports]
    if all(len(found) == 1 for found in positions):
        return [found[0] for found in positions]
    if len(ports) == len(names):
        return list(range(len(names)))
    raise QplugError(f"OpenVINO's compiled model has inputs {[sorted(port.get_names()) for port in ports]}, which "
                     f"cannot be matched to the partition's inputs {list(names)}")


def _int8_constants(model: Any) -> list[torch.Tensor]:
    """Views of the int8 constants (weights) of ``model``, an ``openvino.Model`` read and then
    compiled: the compiled model holds these same buffers, and a view keeps its constant alive.
    Read-only: nothing writes a held weight (numpy flags them so; torch warns, not heeded)."""
    openvino = import_openvino()
    arrays = [op.data for op in model.get_ops()
              if op.get_type_name() == "Constant" and op.get_output_element_type(0) == openvino.Type.i8]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return [torch.from_numpy(array) for array in arrays]


class OpenVinoPartition(CompiledPartition):
    """Runs one int8 partition in OpenVINO (see module docstring)."""

    def __init__(self, partition: fx.GraphModule, example_inputs: tuple[torch.Tensor, ...],
                 to_onnx: Callable[[fx.GraphModule, tuple], bytes], compile_settings: CompileSettings):
        self.compile_settings = compile_settings.resolved()
        self.shape_cache_size = compile_settings.shape_cache_size
        super().__init__(partition, example_inputs, to_onnx)

    def build(self, source: bytes | os.PathLike) -> _Compiled:
        """``source`` (serialized, or a file with its external data: a partition's ``OnnxFile``) compiled."""
        from qplug_core.plugin_api import onnx_input_shapes

        openvino = import_openvino()
        core = openvino.Core()
        properties = self.compile_settings.properties()
        # parsed (weights and all) before the compile, not beside it; the exporter renames an input
        # (``ei`` to ``ei_orig``) and OpenVINO orders its parameters otherwise: a partition input
        # is found by its position among the ONNX model's inputs, not by its FX name
        shapes = onnx_input_shapes(source)
        read = core.read_model(source if isinstance(source, bytes) else os.fspath(source))
        try:
            model = core.compile_model(read, "CPU", properties)
        except RuntimeError as exc:
            if not properties["DYNAMIC_QUANTIZATION_GROUP_SIZE"]:
                raise
            # e.g. oneDNN held to AVX2 on a CPU whose cpuid says AVX-512 has no primitive for it
            model = core.compile_model(read, "CPU", {**properties, "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
            warn_user(f"OpenVINO could not compile dynamic linears with inputs quantized at run time on "
                      f"this CPU ({str(exc).strip().splitlines()[-1][:200]}); their inputs stay float "
                      "(int8 weights, dequantized in the kernel)")
        return _Compiled(model, _input_positions(model.inputs, shapes.names), len(model.outputs), shapes,
                         openvino.Tensor, _int8_constants(read))

    def serves(self, compiled: _Compiled, inputs: tuple[torch.Tensor, ...]) -> bool:
        return compiled.shapes.fit(inputs)

    def runtime(self) -> tuple[str, str]:
        return "openvino", import_openvino().get_version()  # with its build: "2026.4.1-22982-..."

    def runtime_int8(self) -> list[torch.Tensor]:
        """The int8 constants of the first model compiled (OpenVINO's CPU plugin keeps them, its
        graph's source, beside the repacked weights its kernels read), handed over once: the
        views keep their constants alive, so the compiled form lets go of them."""
        if not self._compiled:
            return []
        compiled = self.compiled[0]
        int8, compiled.int8 = compiled.int8, []
        return int8

    def run(self, compiled: _Compiled, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        # the tensors' buffers go in as they are; the request's dict-building ``infer(feeds)``
        # costs ~50 us more per call (measured), which counts at batch 1
        tensor = compiled.tensor
        arrays = [self.as_array(inputs[i]) for i in compiled.positions]
        request, infer = compiled.request()
        try:
            for port, array in enumerate(arrays):
                request.set_input_tensor(port, tensor(array, shared_memory=True))
            infer()
            return [torch.from_numpy(request.get_output_tensor(port).data.copy())
                    for port in range(compiled.outputs)]
        finally:
            compiled.idle.put((request, infer))

    def rebuild(self, compile_settings: CompileSettings) -> None:
        """Compile every model again with other settings (threads)."""
        self.compile_settings = compile_settings.resolved()
        self.shape_cache_size = compile_settings.shape_cache_size
        self.recompile()

    @property
    def compiled_models(self) -> list:
        """The OpenVINO compiled models held (one serves every shape its symbolic sizes take)."""
        return [c.model for c in self.compiled]

    def extra_repr(self) -> str:
        return f"threads={self.compile_settings.num_threads}, compiled={len(self.compiled)}"
