"""One compiled partition: an ONNX Runtime ``InferenceSession`` called with torch tensors.

The session is created once (at convert, and again by ``qp.load``) with the settings in force
(:func:`configure`; threads default to ``torch.get_num_threads()``); a deep copy of the model
runs the same sessions (ORT's ``run`` takes calls from several threads at once). Inputs go to ORT as numpy
views of the (contiguous, CPU) torch tensors and outputs come back as torch views of ORT's
buffers (``torch.from_numpy``), so nothing is copied either way. The partition is exported with
every axis of its inputs symbolic where its graph leaves it free (``to_onnx_proto(...,
flexible=True)``), so one session serves every batch size, sequence or time length >= 2; an input
the session's shapes do not take (size 1 on a symbolic axis, another size on a fixed one) gets a
session compiled for it, kept among the partition's ``shape_cache_size`` least recently used.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from qplug_core.plugin_api import (
    CompiledPartition,
    ConfigValidationError,
    check_cache_size,
    denormals_flushed,
    replaced_settings,
)

#: graph optimization levels by name (``"all"`` is ORT's default and what fuses QDQ groups)
OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
#: ORT graph fusions left out by default because their fused kernel is slower than the ops it
#: replaces: ORT 1.32's CPU SkipLayerNormalization takes 6.0 ms on [8, 128, 384] where Add +
#: LayerNormalization take 0.29 ms (AMD EPYC Zen 4, 1 thread; ``bench/bench_ort_fusions.py``
#: measures it again): 12 of them are ~15% of a MiniLM-L6 session at 8x128 tokens
SLOW_FUSIONS = ("SkipLayerNormFusion",)


@dataclass(frozen=True)
class SessionSettings:
    """How sessions are built: ``num_threads`` (None: ``torch.get_num_threads()`` at build time),
    ``graph_optimization`` (one of :data:`OPTIMIZATION_LEVELS`), ``disabled_optimizers``
    (names of ORT graph transformers not to run, default :data:`SLOW_FUSIONS`) and
    ``flush_denormals`` (floats below 1.2e-38 computed as zero, on ORT's threads and the calling
    one: Softmax over attention scores makes millions of them, at many times a normal float's
    cost; ``qplug_core/partition/denormals.py``), ``allow_spinning`` (ORT's intra-op threads
    spin between ops: lowest latency for one caller; several client threads on few cores ran
    2.8-5x slower than serial with it, 1.2-1.9x without) and ``shape_cache_size`` (sessions a
    partition keeps for shapes its graph fixes, least recently used first out)."""

    num_threads: int | None = None
    graph_optimization: str = "all"
    disabled_optimizers: tuple[str, ...] = SLOW_FUSIONS
    flush_denormals: bool = True
    allow_spinning: bool = True
    shape_cache_size: int = 8

    def __post_init__(self) -> None:
        if self.num_threads is not None and (not isinstance(self.num_threads, int)
                                             or isinstance(self.num_threads, bool) or self.num_threads < 1):
            raise ConfigValidationError(f"num_threads must be a positive int or None, got "
                                        f"{self.num_threads!r}", field="num_threads", value=self.num_threads)
        if self.graph_optimization not in OPTIMIZATION_LEVELS:
            raise ConfigValidationError(f"graph_optimization must be one of {OPTIMIZATION_LEVELS}, got "
                                        f"{self.graph_optimization!r}", field="graph_optimization",
                                        value=self.graph_optimization)
        if not (isinstance(self.disabled_optimizers, tuple)
                and all(isinstance(name, str) for name in self.disabled_optimizers)):
            raise ConfigValidationError(f"disabled_optimizers must be a tuple of ORT optimizer names, got "
                                        f"{self.disabled_optimizers!r}", field="disabled_optimizers",
                                        value=self.disabled_optimizers)
        for name in ("flush_denormals", "allow_spinning"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigValidationError(f"{name} must be True or False, got {getattr(self, name)!r}",
                                            field=name, value=getattr(self, name))
        check_cache_size(self.shape_cache_size)

    def session_options(self):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = self.num_threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # fatal only: a run that fails raises to the caller, and ORT also printed an error line to
        # stderr for each one (a server's log got a line per bad request beside its own report)
        options.log_severity_level = 4
        options.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[self.graph_optimization]
        # ORT's worker threads; OrtPartition flushes on the calling thread
        options.add_session_config_entry("session.set_denormal_as_zero", "1" if self.flush_denormals else "0")
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.allow_spinning else "0")
        return options

    def inference_session(self, model: bytes | os.PathLike, *, optimized_model_filepath: str | None = None):
        """An ``InferenceSession`` of ``model`` (serialized, or a file with its external data: a
        partition's ``OnnxFile``) built with these settings (``optimized_model_filepath``: where
        ORT writes the graph it optimized, to inspect it)."""
        import onnxruntime as ort

        options = self.session_options()
        if optimized_model_filepath is not None:
            options.optimized_model_filepath = optimized_model_filepath
        flushed = denormals_flushed()
        session = ort.InferenceSession(model if isinstance(model, bytes) else os.fspath(model), options,
                                       providers=["CPUExecutionProvider"],
                                       disabled_optimizers=list(self.disabled_optimizers))
        if denormals_flushed() != flushed:  # a one-thread session sets it on the thread building it
            torch.set_flush_denormal(flushed)
        return session


_settings = SessionSettings()
_lock = threading.Lock()


def settings() -> SessionSettings:
    """The settings new sessions are built with."""
    return _settings


def configure(**changes: Any) -> SessionSettings:
    """Change the settings for sessions built from now on (convert, load); returns the previous
    ones, so ``configure(**dataclasses.asdict(previous))`` restores them."""
    global _settings
    with _lock:
        previous = _settings
        _settings = replaced_settings(_settings, changes, "qplug_onnxruntime.configure")
    return previous


class _Compiled:
    """One session, its input and output names, the input types and shapes it takes (an int: that
    size; a name: any size from its smallest up, the same wherever the name recurs), and the call
    that runs it.

    ``call(output_names, feeds)`` is the session's native ``run`` with one ``RunOptions`` made
    here: ``InferenceSession.run`` checks the feed names in Python and builds default run options
    on every call, ~3 us of a ~15 us small CNN at batch 1 (AMD EPYC Zen 4). The names are the
    session's own, so those checks cannot fail; an ORT without the native session keeps ``run``.
    """

    def __init__(self, model: bytes | os.PathLike, session_settings: SessionSettings):
        from qplug_core.plugin_api import onnx_input_shapes_read

        self.session = session_settings.inference_session(model)
        inputs = self.session.get_inputs()
        self.input_names = [i.name for i in inputs]
        self.input_shapes = onnx_input_shapes_read(
            [(i.name, _onnx_element_type(i.type), i.shape) for i in inputs],
            self.session.get_modelmeta().custom_metadata_map)
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.call = native_run(self.session)

    def takes(self, inputs: tuple[torch.Tensor, ...]) -> bool:
        """Whether these inputs fit the session's input types and shapes. A symbolic size only
        takes >= 2 (or the graph's smallest): torch.export specialises size 1, so an input of
        size 1 there gets a session of its own, exported as a fresh compile of its shapes would
        be (the session answering an input depends on its shapes alone, as after ``qp.load``)."""
        return self.input_shapes.fit(inputs)


def _onnx_element_type(ort_type: str) -> int:
    """ONNX's number of an ORT input type, ``tensor(float)`` -> ``TensorProto.FLOAT``."""
    import onnx

    return onnx.TensorProto.DataType.Value(ort_type.removeprefix("tensor(").removesuffix(")").upper())


def native_run(session) -> Callable[[list[str], dict], list]:
    import onnxruntime as ort

    native = getattr(getattr(session, "_sess", None), "run", None)
    if native is None:  # pragma: no cover - an ORT that moved its native session
        return session.run
    options = ort.RunOptions()
    return lambda output_names, feeds: native(output_names, feeds, options)


class OrtPartition(CompiledPartition):
    """Runs one int8 partition in ONNX Runtime (see module docstring)."""

    def __init__(self, partition: fx.GraphModule, example_inputs: tuple[torch.Tensor, ...],
                 to_onnx: Callable[[fx.GraphModule, tuple], bytes], session_settings: SessionSettings):
        self.session_settings = dataclasses.replace(
            session_settings, num_threads=session_settings.num_threads or torch.get_num_threads())
        self.shape_cache_size = session_settings.shape_cache_size
        super().__init__(partition, example_inputs, to_onnx)

    def build(self, source: bytes | os.PathLike) -> _Compiled:
        return _Compiled(source, self.session_settings)

    def serves(self, compiled: _Compiled, inputs: tuple[torch.Tensor, ...]) -> bool:
        return compiled.takes(inputs)

    def runtime(self) -> tuple[str, str]:
        import onnxruntime as ort

        return "onnxruntime", ort.__version__

    def run(self, compiled: _Compiled, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        # numpy views of the torch buffers in, torch views of ORT's output buffers out: no copies
        # (measured faster than IOBinding into preallocated outputs, which ORT copies into)
        names = compiled.input_names
        if len(names) == 1:  # no comprehension frames: ~1 us at batch 1
            feeds = {names[0]: self.as_array(inputs[0])}
        else:
            feeds = {name: self.as_array(tensor) for name, tensor in zip(names, inputs)}
        outputs = compiled.call(compiled.output_names, feeds)
        if len(outputs) == 1:
            return [torch.from_numpy(outputs[0])]
        return [torch.from_numpy(out) for out in outputs]

    def rebuild(self, session_settings: SessionSettings) -> None:
        """Build every session again with other settings (threads, graph optimizations)."""
        self.session_settings = dataclasses.replace(
            session_settings, num_threads=session_settings.num_threads or torch.get_num_threads())
        self.shape_cache_size = session_settings.shape_cache_size
        self.recompile()

    @property
    def flush_denormals(self) -> bool:
        """Flush on the calling thread as the sessions do on ORT's (the settings say which)."""
        return self.session_settings.flush_denormals

    @property
    def sessions(self) -> list:
        """The ORT sessions built so far (one serves every shape its symbolic sizes take)."""
        return [c.session for c in self.compiled]

    def extra_repr(self) -> str:
        s = self.session_settings
        return (f"threads={s.num_threads}, graph_optimization={s.graph_optimization!r}, "
                f"sessions={len(self.compiled)}")
