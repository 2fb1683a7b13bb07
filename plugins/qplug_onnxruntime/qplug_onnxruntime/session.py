"""One compiled partition: an ONNX Runtime ``InferenceSession`` called with torch tensors.

The session is created once (at convert, and again by ``qp.load``) with the settings in force
(:func:`configure`; threads default to ``torch.get_num_threads()``). Inputs go to ORT as numpy
views of the (contiguous, CPU) torch tensors and outputs come back as torch views of ORT's
buffers (``torch.from_numpy``), so nothing is copied either way. An input of another shape gets a
session compiled for it (once per shape).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from qplug_core.plugin_api import ConfigValidationError

#: graph optimization levels by name (``"all"`` is ORT's default and what fuses QDQ groups)
OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")


@dataclass(frozen=True)
class SessionSettings:
    """How sessions are built: ``num_threads`` (None: ``torch.get_num_threads()`` at build time)
    and ``graph_optimization`` (one of :data:`OPTIMIZATION_LEVELS`)."""

    num_threads: int | None = None
    graph_optimization: str = "all"

    def __post_init__(self) -> None:
        if self.num_threads is not None and (not isinstance(self.num_threads, int)
                                             or isinstance(self.num_threads, bool) or self.num_threads < 1):
            raise ConfigValidationError(f"num_threads must be a positive int or None, got "
                                        f"{self.num_threads!r}", field="num_threads", value=self.num_threads)
        if self.graph_optimization not in OPTIMIZATION_LEVELS:
            raise ConfigValidationError(f"graph_optimization must be one of {OPTIMIZATION_LEVELS}, got "
                                        f"{self.graph_optimization!r}", field="graph_optimization",
                                        value=self.graph_optimization)

    def session_options(self):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = self.num_threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[self.graph_optimization]
        return options


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
        _settings = dataclasses.replace(_settings, **changes)
    return previous


class _Compiled:
    """The ONNX model and session of one input signature."""

    def __init__(self, model: bytes, session_settings: SessionSettings):
        import onnxruntime as ort

        self.model = model
        self.session = ort.InferenceSession(model, session_settings.session_options(),
                                            providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]


class OrtPartition(nn.Module):
    """Runs one int8 partition in ONNX Runtime (see module docstring)."""

    def __init__(self, partition: fx.GraphModule, example_inputs: tuple[torch.Tensor, ...],
                 to_onnx: Callable[[fx.GraphModule, tuple], bytes], session_settings: SessionSettings):
        super().__init__()
        # kept outside the module tree (not a submodule) to compile other input shapes
        self.__dict__["_partition"] = partition
        self._to_onnx = to_onnx
        self.session_settings = dataclasses.replace(
            session_settings, num_threads=session_settings.num_threads or torch.get_num_threads())
        self._sessions: dict[tuple, _Compiled] = {}
        self._single_output = True
        self._compile(example_inputs)

    @staticmethod
    def _signature(inputs) -> tuple:
        return tuple((tuple(t.shape), t.dtype) for t in inputs)

    def _compile(self, inputs: tuple[torch.Tensor, ...]) -> _Compiled:
        with torch.no_grad():  # the output structure (tensor or tuple) the partition returns
            self._single_output = isinstance(self._partition(*inputs), torch.Tensor)
        compiled = _Compiled(self._to_onnx(self._partition, inputs), self.session_settings)
        self._sessions[self._signature(inputs)] = compiled
        return compiled

    def rebuild(self, session_settings: SessionSettings) -> None:
        """Build every session again with other settings (threads, graph optimizations)."""
        self.session_settings = dataclasses.replace(
            session_settings, num_threads=session_settings.num_threads or torch.get_num_threads())
        self._sessions = {signature: _Compiled(c.model, self.session_settings)
                          for signature, c in self._sessions.items()}

    @property
    def sessions(self) -> list:
        """The ORT sessions built so far (one per input signature)."""
        return [c.session for c in self._sessions.values()]

    def forward(self, *inputs: torch.Tensor):
        compiled = self._sessions.get(self._signature(inputs)) or self._compile(inputs)
        # numpy views of the torch buffers in, torch views of ORT's output buffers out: no copies
        # (measured faster than IOBinding into preallocated outputs, which ORT copies into)
        feeds = {name: tensor.detach().contiguous().numpy()
                 for name, tensor in zip(compiled.input_names, inputs)}
        results = [torch.from_numpy(out) for out in compiled.session.run(compiled.output_names, feeds)]
        return results[0] if self._single_output else tuple(results)

    def __deepcopy__(self, memo: dict) -> OrtPartition:
        """Sessions cannot be copied: the copy builds its own from the same ONNX models."""
        clone = OrtPartition.__new__(OrtPartition)
        nn.Module.__init__(clone)
        clone.__dict__["_partition"] = copy.deepcopy(self._partition, memo)
        clone._to_onnx = self._to_onnx
        clone._single_output = self._single_output
        clone._sessions = dict(self._sessions)
        clone.rebuild(self.session_settings)
        return clone

    def extra_repr(self) -> str:
        s = self.session_settings
        return (f"threads={s.num_threads}, graph_optimization={s.graph_optimization!r}, "
                f"sessions={len(self._sessions)}")
