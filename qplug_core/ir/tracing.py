"""torch's own ways of tracing and shipping a model, met by qplug's int8 modules.

A compiled partition (ONNX Runtime, OpenVINO) or a weight-only kernel running in ONNX Runtime
hands numpy arrays to its runtime: the tracer records no op for that, only the result it saw, so a
traced onnxruntime model answered every input with its output for the trace's example (SQNR
-1.7 dB on a new input) beside torch's generic tracer warnings. Such modules refuse the tracer.
``torch.export``, ``torch.jit.script`` and pickle of an int8 model ended in raw torch errors (one
printed a serialized ONNX model), so they are refused too, each pointing at what ships the model;
a ``state_dict`` without the int8 weights (packed, or in another runtime) says so once.
Code torch.compile must run eagerly is marked with :func:`run_eagerly`, which imports dynamo only
once dynamo is in use.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Any, Callable, Iterator, NoReturn, Sequence, TypeVar

import torch
from torch import nn

from qplug_core.errors import ModelStateError, SerializationError, warn_user

#: what ships an int8 model instead of torch's serializers and compilers
SHIP_INSTEAD = ("Ship it with qp.save(model, 'model.safetensors') and read it back with qp.load(path) "
                "(qp.load(path, model=float_model) for qp.quantize_dynamic / quantize_weights / "
                "quantize_w8a8 models), or as ONNX with qp.export_onnx")

PICKLE_MESSAGE = ("a qplug int8 model cannot be pickled (torch.save / pickle.dump): its kernels hold "
                  "packed weights and compiled runtimes chosen for this CPU, and unpickling runs code. "
                  + SHIP_INSTEAD)

SCRIPT_MESSAGE = ("torch.jit.script cannot compile a qplug int8 model: its int8 layers are Python code "
                  "around packed weights and other runtimes. Script or export the float model instead; "
                  + SHIP_INSTEAD[0].lower() + SHIP_INSTEAD[1:])


_F = TypeVar("_F", bound=Callable[..., Any])


def run_eagerly(fn: _F) -> _F:
    """``fn`` as ``@torch.compiler.disable`` makes it (torch.compile runs it eagerly, a graph break
    around it), but without importing ``torch._dynamo`` where it is applied: that decorator does,
    which cost every process that imports qplug's pipeline (a server's worker loading a model)
    +71 MiB RSS and seconds. The disabled form is made at the first call with dynamo loaded; without
    dynamo nothing is compiling, and ``fn`` runs as it is."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call  # type: ignore[return-value]


def refuse_pickle(self: Any, *args: Any) -> NoReturn:
    """``__reduce_ex__`` / ``__reduce__`` of a class whose instances must not be pickled."""
    raise SerializationError(PICKLE_MESSAGE)


def refuse_script(self: Any) -> NoReturn:
    """``__prepare_scriptable__``: torch.jit.script calls it on the module and every submodule first."""
    raise ModelStateError(SCRIPT_MESSAGE)


def refuse_tracing(what: str, inputs: Sequence[Any], why: str = "it computes outside PyTorch") -> None:
    """Raise :class:`ModelStateError` when ``torch.jit.trace`` or ``torch.export`` is recording
    this call of ``what`` on ``inputs`` (``what`` runs outside PyTorch, so a trace would hold its
    answer to the example as a constant)."""
    if torch.jit.is_tracing():
        raise ModelStateError(
            f"torch.jit.trace cannot record {what}: {why}, so the trace would return its answer "
            "for the example input whatever the input. Ship the model with qp.save / qp.load, or as "
            "ONNX with qp.export_onnx")
    refuse_export(what, inputs)


#: torch's key of the fake tensor mode among the dispatch modes active on a thread
_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE


def being_exported(inputs: Sequence[Any]) -> bool:
    """Whether torch.export is tracing this call on ``inputs``. ``torch.compiler.is_exporting()``
    says only that some thread of the process is exporting (a warm-up exporting a hot-reloaded
    onnxruntime model made every other thread's int8 calls raise), so the evidence is this thread's:
    dynamo tracing the call (strict export), a fake tensor mode active on it, or inputs that are
    tensor subclasses (fake or functional tensors; a real input is a plain tensor)."""
    if not torch.compiler.is_exporting():
        return False
    if torch.compiler.is_dynamo_compiling() or torch._C._get_dispatch_mode(_FAKE_MODE) is not None:
        return True
    return any(isinstance(x, torch.Tensor) and type(x) is not torch.Tensor and not isinstance(x, nn.Parameter)
               for x in inputs)


def refuse_export(what: str, inputs: Sequence[Any]) -> None:
    """Raise :class:`ModelStateError` when ``torch.export`` traces this call of ``what`` on
    ``inputs`` (fake tensors have no data for packed weights or another runtime)."""
    if being_exported(inputs):
        raise ModelStateError(
            f"torch.export cannot capture {what}: its int8 weights are packed or held by another "
            "runtime, which fake tensors cannot run. Export the float model instead (qp.quantize "
            "takes the ExportedProgram's module), or a graph-mode model's reference form with "
            "qp.export_program(model, example_inputs) (int8 weights in torch's quantized_decomposed "
            "ops, what torch.compile, AOTInductor and ExecuTorch take); " + SHIP_INSTEAD[0].lower()
            + SHIP_INSTEAD[1:])


STATE_DICT_MESSAGE = ("this state_dict holds no int8 weights of the model's packed int8 layers or compiled "
                      "partitions (they live outside it), so saving it keeps nothing of them and "
                      "load_state_dict cannot restore them. " + SHIP_INSTEAD)

_INTERNAL = threading.local()


@contextlib.contextmanager
def reading_state_dict() -> Iterator[None]:
    """qplug's own ``state_dict()`` calls (file writers, size measures), which know what is in it."""
    _INTERNAL.depth = getattr(_INTERNAL, "depth", 0) + 1
    try:
        yield
    finally:
        _INTERNAL.depth -= 1


def warn_state_dict_incomplete(destination: Any) -> None:
    """From a module's ``_save_to_state_dict``: warn once per ``state_dict()`` call (the
    destination is shared by every module it visits) that the int8 weights are not in it."""
    if getattr(_INTERNAL, "depth", 0) or getattr(destination, "_qplug_warned", False):
        return
    destination._qplug_warned = True
    warn_user(STATE_DICT_MESSAGE)
