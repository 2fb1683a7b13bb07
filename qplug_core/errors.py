"""The exception hierarchy of qplug.

Every failure a user can cause (bad input, bad config, a broken plugin) surfaces as a subclass of
:class:`QplugError`, never as a bare ``AssertionError``/``KeyError`` from deep inside torch. Errors
carry structured attributes so that tools (the CLI, reports) can show them without parsing text,
and messages say what failed, where, and how to fix it.
"""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import difflib
import logging
import sys
import warnings
from typing import Any, Iterable, Iterator, Sequence


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for a close candidate, else an empty string."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def first_line(error: BaseException) -> str:
    """The first line of an error's message (torch's are long), or its type's name."""
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


#: whether a ``qplug`` command is running: messages that suggest a fix name the one the reader
#: can type (``backend=...`` in Python, ``--backend NAME`` in the shell)
_CLI_AUDIENCE = contextvars.ContextVar("cli_audience", default=False)


def spelled(python: str, cli: str) -> str:
    """``python`` for library users, ``cli`` while a ``qplug`` command runs."""
    return cli if _CLI_AUDIENCE.get() else python


@contextlib.contextmanager
def cli_audience() -> Iterator[None]:
    """Messages raised inside speak the command line's language."""
    token = _CLI_AUDIENCE.set(True)
    try:
        yield
    finally:
        _CLI_AUDIENCE.reset(token)


def notify(message: str) -> None:
    """Tell the user something that is not a problem (which backend was picked, how batches were
    shared): a ``qplug: ...`` line on stderr, or an INFO record of the ``qplug`` logger once the
    application gives that logger a handler (to route or silence these lines)."""
    logger = logging.getLogger("qplug")
    if logger.handlers:
        logger.info(message)
    else:
        print(f"qplug: {message}", file=sys.stderr)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn at the first frame outside qplug (the core, its plugins), torch and the code torch.fx
    generates, so the warning points at the user's call: a delegated partition's warnings pass
    through the model's generated forward, torch's module calls and dynamo's wrappers. The message
    starts with ``qplug:`` (added where it does not), which users filter qplug's warnings on."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and _inner(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message if message.startswith("qplug:") else f"qplug: {message}", category, stacklevel=level)


def _inner(frame: Any) -> bool:
    """Whether ``frame`` runs qplug's or torch's code (a GraphModule's generated forward counts)."""
    name = frame.f_globals.get("__name__") or ""
    return name.startswith(("qplug_", "torch.")) or name == "torch" \
        or frame.f_code.co_filename.startswith("<eval_with_key>")


class QplugError(Exception):
    """Root of every error qplug raises on purpose."""


# -- plugins ---------------------------------------------------------------------------------------


class PluginError(QplugError):
    """A plugin failed; ``plugin`` and ``dist`` say which one."""

    def __init__(self, message: str, *, plugin: str | None = None, dist: str | None = None,
                 version: str | None = None, hook: str | None = None):
        super().__init__(message)
        self.plugin = plugin
        self.dist = dist
        self.version = version
        self.hook = hook


class PluginLoadError(PluginError):
    """Importing or registering a plugin failed."""


class PluginHookError(PluginError):
    """A plugin's hook implementation raised while being called."""


class PluginContractError(PluginError):
    """A plugin's hook returned something that does not satisfy the hook's contract."""


class DuplicateBackendError(PluginError):
    """Two plugins register a backend with the same name."""

    def __init__(self, message: str, *, backend: str, dists: Sequence[str]):
        super().__init__(message)
        self.backend = backend
        self.dists = tuple(dists)


# -- backends --------------------------------------------------------------------------------------


class BackendError(QplugError):
    """A backend cannot be found or used."""

    def __init__(self, message: str, *, backend: str | None = None):
        super().__init__(message)
        self.backend = backend


class BackendNotFoundError(BackendError):
    """No installed plugin provides the requested backend."""


class BackendUnavailableError(BackendError):
    """The backend is installed but cannot run (engine missing, wrong CPU, its plugin broken...)."""


class DelegateRuntimeError(BackendError):
    """A delegated partition's compiled module raised on inputs its reference form cannot take
    either (the inputs, not the runtime, are wrong); ``plugin``, ``dist`` and ``partition`` say
    where, and the runtime's exception is the cause."""

    def __init__(self, message: str, *, backend: str | None = None, plugin: str | None = None,
                 dist: str | None = None, partition: str | None = None):
        super().__init__(message, backend=backend)
        self.plugin, self.dist, self.partition = plugin, dist, partition


class KernelRuntimeError(BackendError, RuntimeError):
    """A backend's per-op kernel raised while a converted model ran; ``plugin``, ``dist``,
    ``kernel`` and ``layer`` say where, and the kernel's exception is the cause. Also a
    ``RuntimeError``, as torch's own kernel errors are, so callers catching those still catch it."""

    def __init__(self, message: str, *, backend: str | None = None, plugin: str | None = None,
                 dist: str | None = None, kernel: str | None = None, layer: str | None = None):
        super().__init__(message, backend=backend)
        self.plugin, self.dist, self.kernel, self.layer = plugin, dist, kernel, layer


# -- configs and patterns --------------------------------------------------------------------------


class ConfigError(QplugError):
    """A config object or document is invalid; ``field`` is the path of the bad value."""

    def __init__(self, message: str, *, field: str | None = None, value: Any = None):
        super().__init__(message)
        self.field = field
        self.value = value


class ConfigValidationError(ConfigError):
    """A config value fails validation when the object is built."""


class UnsupportedKeywordError(ConfigValidationError, TypeError):
    """A keyword qplug does not take (torch.ao's ``prepare_custom_config=``...), with qplug's way instead.

    Also a ``TypeError``, which Python raises for an unexpected keyword, so code catching it keeps working.
    """


class DuplicatePatternError(ConfigError):
    """A pattern is registered twice for one backend (pass ``replace=True`` to override)."""


class ConstraintViolationError(ConfigError):
    """A user's qconfig cannot be honoured by the backend's dtype constraints."""


class PatternError(ConfigError):
    """A fusion/quantization pattern is malformed; ``position`` locates the bad element."""

    def __init__(self, message: str, *, pattern: Any = None, position: tuple[int, ...] | None = None):
        super().__init__(message, field="pattern", value=pattern)
        self.pattern = pattern
        self.position = position


# -- graphs ----------------------------------------------------------------------------------------


class GraphError(QplugError):
    """Something went wrong capturing or transforming a graph."""

    def __init__(self, message: str, *, node: str | None = None):
        super().__init__(message)
        self.node = node


class TraceError(GraphError):
    """The model cannot be captured as a torch.fx graph."""

    def __init__(self, message: str, *, module: str | None = None, node: str | None = None):
        super().__init__(message, node=node)
        self.module = module


class PassError(GraphError, RuntimeError):
    """A graph pass failed or left an invalid graph; the input GraphModule is unchanged.

    Also a ``RuntimeError``, which torch.fx's pass infrastructure raises in the same situation, so
    code catching the builtin type keeps working.
    """

    def __init__(self, message: str, *, pass_name: str | None = None,
                 completed_passes: Sequence[str] = (), node: str | None = None):
        super().__init__(message, node=node)
        self.pass_name = pass_name
        self.completed_passes = tuple(completed_passes)


class InputMismatchError(QplugError):
    """The example or calibration inputs do not fit the model (wrong count, shape or dtype)."""


#: (builtin error type) -> an InputMismatchError that is also one, made once
_ALSO_BUILTIN: dict[type, type] = {}


def input_mismatch(message: str, builtin: type[BaseException]) -> InputMismatchError:
    """An :class:`InputMismatchError` also of the builtin type ``builtin`` (``IndexError``,
    ``RuntimeError``...) where the float model raises that type, so a caller's ``except
    RuntimeError`` catches ours as it caught torch's; of no other type for a non-builtin one."""
    if builtin.__module__ != "builtins" or not issubclass(builtin, Exception):
        return InputMismatchError(message)
    return _also_builtin(builtin)(message)


_ALSO_PREFIX = "InputMismatchError_"


def _also_builtin(builtin: type[Exception]) -> type[InputMismatchError]:
    """The class of :func:`input_mismatch`'s errors for ``builtin``, made once, with a qualified
    name pickle finds (:func:`__getattr__`): the error crosses to a worker pool's parent."""
    if builtin not in _ALSO_BUILTIN:
        try:
            _ALSO_BUILTIN[builtin] = type(InputMismatchError.__name__, (InputMismatchError, builtin),
                                          {"__module__": __name__, "__qualname__": _ALSO_PREFIX + builtin.__name__})
        except TypeError:  # a builtin whose instances are laid out otherwise (OSError)
            _ALSO_BUILTIN[builtin] = InputMismatchError
    return _ALSO_BUILTIN[builtin]


def __getattr__(name: str) -> type:
    """``InputMismatchError_RuntimeError`` and its kin, for pickle in a process that has not made
    them yet (builtin exception types only)."""
    builtin = getattr(builtins, name.removeprefix(_ALSO_PREFIX), None) if name.startswith(_ALSO_PREFIX) else None
    if isinstance(builtin, type) and issubclass(builtin, Exception):
        return _also_builtin(builtin)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ModelStateError(QplugError):
    """The model is in a state the requested step cannot use (e.g. converting a QAT model in train mode)."""


# -- calibration and numerics ----------------------------------------------------------------------


class CalibrationError(QplugError):
    """Calibration data is missing or unusable."""

    def __init__(self, message: str, *, node: str | None = None):
        super().__init__(message)
        self.node = node


class UncalibratedObserverError(CalibrationError):
    """qparams were requested from observers that never saw data; ``nodes`` lists them."""

    def __init__(self, message: str, *, nodes: Sequence[str] = ()):
        super().__init__(message, node=nodes[0] if nodes else None)
        self.nodes = tuple(nodes)


class NonFiniteCalibrationError(CalibrationError):
    """Calibration data contains NaN or Inf; ``count`` says how many values."""

    def __init__(self, message: str, *, node: str | None = None, count: int = 0):
        super().__init__(message, node=node)
        self.count = count


class DistributedCalibrationError(CalibrationError):
    """Observers cannot agree across the ranks of a process group (an observer class that does not
    declare how it reduces, ranks with different observers or different numbers of batches)."""


class NumericOverflowError(QplugError):
    """An int8 computation would overflow its accumulator or bias range."""


# -- serialization ---------------------------------------------------------------------------------


class NothingQuantizedError(QplugError):
    """A conversion produced no int8 region at all: the "quantized" model would be the float one.

    ``reasons`` lists the most frequent reasons ops stayed float (reason, number of ops).
    """

    def __init__(self, message: str, *, reasons: Sequence[tuple[str, int]] = ()):
        super().__init__(message)
        self.reasons = list(reasons)


class SerializationError(QplugError):
    """A saved model cannot be written or read."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class UnsafeFileError(SerializationError):
    """The file would need unpickling (code execution) to load."""


# -- export ----------------------------------------------------------------------------------------


class ExportError(QplugError):
    """A quantized model cannot be expressed in the requested exchange format (ONNX QDQ)."""
