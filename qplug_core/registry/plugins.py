"""Plugin discovery and loading, with fault isolation.

Plugins are modules named by entry points in the ``qplug`` group, plus the core's own built-in
plugins (:data:`DEFAULT_PLUGINS`, registered through the very same hooks, as llm and datasette do).
They are loaded once, on first use. One broken plugin never stops the others: a plugin whose
import raises, whose hooks fail pluggy's validation, whose hook raises or returns the wrong type is
recorded as a :class:`PluginRecord` with a non-``ok`` status, reported once on stderr, and skipped.

Environment switches (read when the manager is built, see :func:`reset`):

- ``QPLUG_LOAD_PLUGINS``: comma list of entry-point or distribution names to load; empty means none.
- ``QPLUG_DISABLE_PLUGINS``: comma list of names never to import.
- ``QPLUG_STRICT_PLUGINS=1``: raise the first plugin failure instead of skipping the plugin.
- ``QPLUG_TRACE_HOOKS=1``: print every hook call, its result type and duration on stderr.

Plugins run fenced (:mod:`qplug_core.registry.isolation`): their stdout goes to stderr, an import
cannot leave warning filters or a changed quantized engine behind, and slow imports are named.
Loading and the backends derived from the plugins are built once, under one process-wide lock, so
the first qplug calls of two threads see the same complete set of plugins.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import inspect
import os
import sys
import threading
import time
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from qplug_core.enums import PluginStatus
from qplug_core.errors import PluginContractError, PluginError, PluginHookError, PluginLoadError, notify
from qplug_core.registry import hookspecs
from qplug_core.registry import isolation as plugin_isolation

ENTRY_POINT_GROUP = "qplug"
CORE_DISTRIBUTION = "qplug-core"

#: Built-in plugins: name -> "module" or "module:object" (as in an entry point), loaded before entry
#: points and always (QPLUG_LOAD_PLUGINS only filters entry points), so that the core's own backend
#: is assembled exactly like a third party's.
DEFAULT_PLUGINS: dict[str, str] = {"reference": "qplug_core.registry.reference:plugin"}

ENV_LOAD = "QPLUG_LOAD_PLUGINS"
ENV_DISABLE = "QPLUG_DISABLE_PLUGINS"
ENV_STRICT = "QPLUG_STRICT_PLUGINS"
ENV_TRACE = "QPLUG_TRACE_HOOKS"


class QplugPluginWarning(UserWarning):
    """A plugin was skipped (broken, incompatible, shadowed) or a requested one is missing."""


def warn_plugin(message: str) -> None:
    """A :class:`QplugPluginWarning`: one line on stderr (a pseudo location, no source line)."""
    # not warn_user: a plugin skipped while plugins load is no fault of the line that loaded them
    # (often an import), so the warning points at no line of the user's code
    warnings.warn_explicit(message, QplugPluginWarning, filename="qplug", lineno=0)


@dataclass
class PluginRecord:
    """What became of one plugin: where it comes from and whether it works."""

    name: str
    dist: str | None
    version: str | None
    status: PluginStatus = PluginStatus.OK
    error: PluginError | None = None
    module: str = ""
    builtin: bool = False
    #: how long importing and registering it took (``None``: not imported)
    load_seconds: float | None = None

    @property
    def label(self) -> str:
        """``'x' (qplug-x 0.3)``: how messages name a plugin."""
        origin = f" ({self.dist} {self.version})" if self.dist else ""
        return f"{self.name!r}{origin}"

    def attribution(self) -> dict[str, str | None]:
        """Keyword arguments naming this plugin in a :class:`PluginError`."""
        return {"plugin": self.name, "dist": self.dist, "version": self.version}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dist": self.dist, "version": self.version,
                "module": self.module, "builtin": self.builtin, "status": self.status.value,
                "error": str(self.error) if self.error else None,
                "load_seconds": None if self.load_seconds is None else round(self.load_seconds, 4)}


@dataclass(frozen=True)
class EntryPointInfo:
    """A ``qplug`` entry point as read from distribution metadata, without importing anything."""

    name: str
    value: str
    dist: str
    version: str
    requires: tuple[str, ...] = ()
    location: str = ""
    entry_point: importlib.metadata.EntryPoint | None = field(default=None, compare=False, repr=False)

    def record(self) -> PluginRecord:
        return PluginRecord(self.name, self.dist, self.version, module=self.value)


@dataclass
class HookResult:
    """One plugin's answer to one hook call: ``value`` when it succeeded, else ``error``."""

    record: PluginRecord
    value: Any = None
    error: PluginError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def core_version() -> str | None:
    """Version of the installed ``qplug-core`` distribution (``None`` in an uninstalled checkout)."""
    try:
        return importlib.metadata.version(CORE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def core_requirement_problem(requires: typing.Iterable[str], version: str | None) -> str | None:
    """Why a plugin's ``Requires-Dist`` rules out core ``version`` (checked before importing it)."""
    if version is None:
        return None
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != CORE_DISTRIBUTION:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if not req.specifier.contains(version, prereleases=True):
            return f"requires {CORE_DISTRIBUTION}{req.specifier}, found {version}"
    return None


def discover() -> list[EntryPointInfo]:
    """All ``qplug`` entry points of the visible distributions, in ``sys.path`` order.

    The same distribution seen twice at one location (a path listed twice) counts once; the same
    entry-point name from two places is kept here and resolved (with a warning) by the loader.
    """
    found: list[EntryPointInfo] = []
    seen: set[tuple[str, str]] = set()
    for dist in importlib.metadata.distributions():
        eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        name = dist.metadata["Name"] or "?"
        location = str(dist.locate_file(""))
        if not eps or (canonicalize_name(name), location) in seen:
            continue
        seen.add((canonicalize_name(name), location))
        for ep in eps:
            found.append(EntryPointInfo(ep.name, ep.value, name, dist.version,
                                        tuple(dist.requires or ()), location, ep))
    return found


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {canonicalize_name(part.strip()) for part in raw.split(",") if part.strip()}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _describe(value: Any) -> str:
    """The shape of a returned value, for contract errors (``list[str]``, ``dict[str, int]``)."""
    def names(items: typing.Iterable[Any]) -> str:
        return " | ".join(sorted({type(item).__name__ for item in items})) or "?"

    if isinstance(value, list):
        return f"list[{names(value)}]" if value else "list"
    if isinstance(value, dict):
        return f"dict[{names(value)}, {names(value.values())}]" if value else "dict"
    return type(value).__name__


class _PatternAnnotation:
    """Stands for ``Pattern`` in return annotations: a type, a callable, a method name or a tuple."""


class _AnnotationNamespace(dict):
    """Resolves the names used in hookspec annotations on demand.

    Importing them all up front would import torch (kernels) just to check a backend list. Where
    each name lives is read from the ``TYPE_CHECKING`` imports of :mod:`qplug_core.registry.hookspecs`, the
    one place the hook contract types are named.
    """

    def __missing__(self, key: str) -> Any:
        if key == "Pattern":
            return _PatternAnnotation
        where = _hookspec_annotation_modules()
        if key in where:
            return getattr(importlib.import_module(where[key]), key)
        raise KeyError(key)


@functools.lru_cache(maxsize=None)
def _hookspec_annotation_modules() -> dict[str, str]:
    """name -> module of every ``from M import name`` under ``if TYPE_CHECKING:`` in hookspecs."""
    tree = ast.parse(inspect.getsource(hookspecs))
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom) and statement.module:
                    found.update({alias.asname or alias.name: statement.module
                                  for alias in statement.names})
    return found


def conforms(value: Any, annotation: Any) -> bool:
    """Whether ``value`` satisfies a resolved return annotation (deeply, for lists and dicts)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return True
    if annotation is None or annotation is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(conforms(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items())
    if annotation is _PatternAnnotation:
        return isinstance(value, (type, str, tuple)) or callable(value)
    if origin is Callable or annotation is Callable:
        return callable(value)
    if annotation is type or origin is type:
        return isinstance(value, type)
    return isinstance(value, annotation)


@dataclass
class Candidate:
    """A plugin to load, with its status as far as metadata can tell (before any import)."""

    record: PluginRecord
    load: Callable[[], object]
    requires: tuple[str, ...] = ()


def _load_error(record: PluginRecord, exc: BaseException) -> PluginLoadError:
    error = PluginLoadError(f"plugin {record.label} failed to load: {_one_line(exc)}; disable with "
                            f"{ENV_DISABLE}={record.name}", **record.attribution())
    error.__cause__ = exc
    return error


def plan() -> tuple[list[Candidate], list[str]]:
    """Which plugins would load, decided from metadata and the environment only.

    Returns the built-in plugins and the entry points selected by ``QPLUG_LOAD_PLUGINS`` with
    status ``ok`` (to import), ``disabled``, ``incompatible`` (``Requires-Dist`` rules out this
    core) or ``conflict`` (entry-point name already taken: the first one on ``sys.path`` is kept);
    and the names in ``QPLUG_LOAD_PLUGINS`` that match nothing.
    """
    wanted, disabled = _env_names(ENV_LOAD), _env_names(ENV_DISABLE) or set()
    version = core_version()
    candidates = [Candidate(PluginRecord(name, CORE_DISTRIBUTION, version, module=value, builtin=True),
                            importlib.metadata.EntryPoint(name, value, ENTRY_POINT_GROUP).load)
                  for name, value in DEFAULT_PLUGINS.items()]
    found: set[str] = set(DEFAULT_PLUGINS)
    seen: set[tuple[str, str, str]] = set()
    for info in discover():
        keys = {canonicalize_name(info.name), canonicalize_name(info.dist)}
        identity = (info.name, canonicalize_name(info.dist), info.version)
        if identity in seen:  # one distribution's metadata seen twice (e.g. a leftover egg-info)
            continue
        seen.add(identity)
        if wanted is None or keys & wanted:
            found |= keys
            candidates.append(Candidate(info.record(), info.entry_point.load, info.requires))
    taken: dict[str, PluginRecord] = {}
    for candidate in candidates:
        record = candidate.record
        problem = core_requirement_problem(candidate.requires, version)
        if {canonicalize_name(record.name), canonicalize_name(record.dist or "")} & disabled:
            record.status = PluginStatus.DISABLED
        elif record.name in taken:
            kept = taken[record.name]
            record.status, record.error = PluginStatus.CONFLICT, PluginLoadError(
                f"plugin {record.label} ignored: the name {record.name!r} is already taken by "
                f"{kept.dist} {kept.version} (kept); uninstall one of the two distributions",
                **record.attribution())
        elif problem:
            record.status, record.error = PluginStatus.INCOMPATIBLE, PluginLoadError(
                f"plugin {record.label} skipped: {problem}; install a compatible version or "
                f"disable it with {ENV_DISABLE}={record.name}", **record.attribution())
        else:
            taken[record.name] = record
    return candidates, sorted((wanted or set()) - found)


#: serialises plugin loading and building what is derived from the plugins (re-entrant, so that
#: the loading thread itself is recognised when a plugin calls back into qplug)
_LOCK = threading.RLock()
_NOT_LOADED, _LOADING, _LOADED = "not loaded", "loading", "loaded"
_REENTRANT = ("qplug's API was called while qplug is {what} (a plugin calling qp.list_backends(), "
              "qp.get_backend() or qp.quantize() at import time or from a hook); call it later, "
              "from your own code, not while plugins load")


#: what every plugin imports first: their seconds are not a plugin's own
_SHARED_IMPORTS = ("torch", "qplug_core.plugin_api")


def _import_shared() -> None:
    for name in _SHARED_IMPORTS:
        if name not in sys.modules:
            importlib.import_module(name)


def _is_backend_plugin_class(plugin: object) -> bool:
    """Whether an entry point named a BackendPlugin subclass, not its instance: its hooks are
    plain functions then, each missing ``self``. Refused rather than instantiated: the entry
    point names the plugin object, which other tools read too, and a class may need arguments."""
    from qplug_core.registry.backend_plugin import BackendPlugin

    return isinstance(plugin, type) and issubclass(plugin, BackendPlugin)


class QplugPluginManager:
    """pluggy's PluginManager plus records, safe loading and isolated, type-checked hook calls."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.strict = os.environ.get(ENV_STRICT, "") == "1"
        self.trace = os.environ.get(ENV_TRACE, "") == "1"
        self.records: list[PluginRecord] = []
        #: scratch space for values derived from the loaded plugins (assembled backends); it goes
        #: away with the manager, so a :func:`reset` invalidates it.
        self.cache: dict[str, Any] = {}
        self._by_name: dict[str, PluginRecord] = {}
        self._warned: set[int] = set()
        self._return_types: dict[str, tuple[Any, str]] = {}
        self._state = _NOT_LOADED
        self._building: set[str] = set()

    @property
    def ready(self) -> bool:
        return self._state == _LOADED

    # -- loading -----------------------------------------------------------------------------------

    def load(self) -> None:
        """Import and register the plugins :func:`plan` selects (once, under the loading lock)."""
        if self._state == _LOADED:
            return
        with _LOCK:
            if self._state == _LOADING:  # the lock is re-entrant: this is the loading thread
                raise PluginLoadError(_REENTRANT.format(what="loading its plugins"))
            if self._state == _LOADED:
                return
            self._state = _LOADING
            try:
                self._load_all()
            finally:
                self._state = _LOADED

    def _load_all(self) -> None:
        candidates, missing = plan()
        for candidate in candidates:
            record = candidate.record
            self.records.append(record)
            if record.error is not None:
                self._announce(record)
            elif record.status is PluginStatus.OK:
                # torch and qplug's plugin API first, for built-ins too: their seconds are not the
                # plugin's to answer for (the import time shown is what the plugin itself
                # imports; the first plugin was charged ~2.5 s of qplug's own), and the engine a
                # plugin may change at import is known
                _import_shared()
                self._register(candidate)
        for name in missing:
            self._warn(f"plugin {name!r} could not be found (named in {ENV_LOAD})")

    def derived(self, key: str, build: Callable[[], Any]) -> Any:
        """``cache[key]``, built once by ``build()`` under the loading lock.

        A plugin that calls back into qplug while ``build`` runs its hooks gets a clear error
        instead of an endless recursion or a half-built value cached for the whole process.
        """
        if key in self.cache:
            return self.cache[key]
        with _LOCK:
            if key in self.cache:
                return self.cache[key]
            if key in self._building:
                raise PluginHookError(_REENTRANT.format(what=f"assembling its {key}"))
            self._building.add(key)
            try:
                self.cache[key] = build()
            finally:
                self._building.discard(key)
            return self.cache[key]

    def _register(self, candidate: Candidate) -> None:
        """Import one plugin and register its hooks; any failure only marks this plugin broken."""
        record = candidate.record
        self._by_name[record.name] = record
        with plugin_isolation.plugin_import() as effects:
            try:
                plugin = candidate.load()
                self.pm.register(plugin, name=record.name)
                exc = None
            except (Exception, SystemExit) as caught:  # KeyboardInterrupt still stops the program
                exc = caught
        record.load_seconds = effects.seconds
        self._report_side_effects(record, effects)
        if exc is None and _is_backend_plugin_class(plugin):
            self.pm.unregister(plugin)
            self._reject(record, PluginStatus.BROKEN, PluginLoadError(
                f"plugin {record.label} failed to load: its entry point names the class "
                f"{plugin.__name__}; name an instance: `plugin = {plugin.__name__}()` in "
                f"{plugin.__module__} and the entry point {plugin.__module__}:plugin; disable with "
                f"{ENV_DISABLE}={record.name}", **record.attribution()))
            return
        if exc is not None:
            self._reject(record, PluginStatus.BROKEN, _load_error(record, exc))
            return
        callers = self.pm.get_hookcallers(plugin) or []
        unknown = [caller.name for caller in callers
                   if not caller.has_spec() and any(
                       impl.plugin is plugin and not impl.optionalhook
                       for impl in caller.get_hookimpls())]
        if not callers:  # e.g. an entry point naming the module of a BackendPlugin, not the instance
            self.pm.unregister(plugin)
            self._reject(record, PluginStatus.BROKEN, _load_error(record, pluggy.PluginValidationError(
                plugin, f"{record.module or record.name} implements no qplug hook; name a module "
                        "of @hookimpl functions or an object with hook methods (module:object, e.g. "
                        "a BackendPlugin instance)")))
        elif unknown:
            self.pm.unregister(plugin)
            self._reject(record, PluginStatus.BROKEN, _load_error(record, pluggy.PluginValidationError(
                plugin, f"unknown hook(s) {', '.join(sorted(unknown))}")))

    def _report_side_effects(self, record: PluginRecord, effects: plugin_isolation.ImportEffects) -> None:
        if effects.engine_changed is not None:
            before, after = effects.engine_changed
            self._warn(f"plugin {record.label} set torch.backends.quantized.engine to {after!r} while "
                       f"being imported; qplug restored {before!r} (backends select their engine "
                       f"only while packing weights); disable it with {ENV_DISABLE}={record.name}")
        if effects.seconds > plugin_isolation.SLOW_IMPORT_SECONDS:
            self._warn(f"plugin {record.label} took {effects.seconds:.1f} s to import (more than "
                       f"{plugin_isolation.SLOW_IMPORT_SECONDS:g} s); see `qplug plugins` for every "
                       f"plugin's load time, or disable it with {ENV_DISABLE}={record.name}")

    # -- failures ----------------------------------------------------------------------------------

    def _reject(self, record: PluginRecord, status: PluginStatus, error: PluginError) -> None:
        """Mark ``record`` failed (its first failure is kept) and announce it."""
        if record.error is None:
            record.status, record.error = status, error
        self._announce(record, error)

    def _announce(self, record: PluginRecord, error: PluginError | None = None) -> None:
        """Warn once per plugin, or raise under strict mode."""
        error = error or record.error
        if self.strict:
            raise error
        if id(record) not in self._warned:
            self._warned.add(id(record))
            self._warn(str(error))

    @staticmethod
    def _warn(message: str) -> None:
        warn_plugin(message)

    # -- calling hooks -----------------------------------------------------------------------------

    def _return_type(self, hook_name: str) -> tuple[Any, str]:
        if hook_name not in self._return_types:
            spec = getattr(self.pm.hook, hook_name).spec.function
            resolved = typing.get_type_hints(spec, localns=_AnnotationNamespace())["return"]
            self._return_types[hook_name] = (resolved, spec.__annotations__["return"])
        return self._return_types[hook_name]

    def collect(self, hook_name: str, **kwargs: Any) -> list[HookResult]:
        """Call every working implementation of ``hook_name`` in registration order, each in
        isolation."""
        self.load()
        return [self._call(impl, hook_name, kwargs) for impl in self._working(hook_name)]

    def collect_first(self, hook_name: str, **kwargs: Any) -> HookResult | None:
        """firstresult semantics: the latest registered implementation answering non-``None`` wins."""
        self.load()
        for impl in reversed(self._working(hook_name)):
            result = self._call(impl, hook_name, kwargs)
            if result.ok and result.value is not None:
                return result
        return None

    def _working(self, hook_name: str) -> list[pluggy.HookImpl]:
        """The implementations of plugins with no failure so far: a plugin is skipped from its
        first failure on, or one that fails for every backend (an entry point naming a class)
        would be charged to each backend assembled after it, ``reference`` included."""
        return [impl for impl in getattr(self.pm.hook, hook_name).get_hookimpls()
                if self._by_name[impl.plugin_name].status is PluginStatus.OK]

    def _call(self, impl: pluggy.HookImpl, hook_name: str, kwargs: dict[str, Any]) -> HookResult:
        record = self._by_name[impl.plugin_name]
        expected, expected_text = self._return_type(hook_name)
        attribution = {**record.attribution(), "hook": hook_name}
        started = time.perf_counter()
        try:
            with plugin_isolation.plugin_call():
                value = impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
        except (Exception, SystemExit) as exc:  # sys.exit in a hook is a broken plugin, not an exit
            error: PluginError = PluginHookError(
                f"plugin {record.label}: hook {hook_name} raised {_one_line(exc)}; disable with "
                f"{ENV_DISABLE}={record.name}", **attribution)
            error.__cause__ = exc
            return self._hook_failed(record, error)
        if self.trace:
            elapsed = (time.perf_counter() - started) * 1000
            notify(f"trace {hook_name}({kwargs}) by {record.label} -> {_describe(value)} "
                   f"in {elapsed:.1f} ms")
        if not conforms(value, expected):
            return self._hook_failed(record, PluginContractError(
                f"plugin {record.label}: hook {hook_name} must return {expected_text}, got "
                f"{_describe(value)}; nothing it returned is used; disable with "
                f"{ENV_DISABLE}={record.name}", **attribution))
        return HookResult(record, value)

    def _hook_failed(self, record: PluginRecord, error: PluginError) -> HookResult:
        self._reject(record, PluginStatus.BROKEN, error)
        return HookResult(record, error=error)


_manager: QplugPluginManager | None = None


def get_manager() -> QplugPluginManager:
    """The process-wide manager, loading plugins on first use (other threads wait for it)."""
    global _manager
    manager = _manager
    if manager is not None and manager.ready:
        return manager
    with _LOCK:
        if _manager is None:
            _manager = QplugPluginManager()
        manager = _manager
    manager.load()
    return manager


def reset() -> None:
    """Forget the loaded plugins and everything derived from them; the next use reloads.

    Environment switches are read again, so tests set them and call this.
    """
    global _manager
    _manager = None


def collect(hook_name: str, **kwargs: Any) -> list[HookResult]:
    """Call ``hook_name`` on every plugin in isolation; see :meth:`QplugPluginManager.collect`."""
    return get_manager().collect(hook_name, **kwargs)


def collect_first(hook_name: str, **kwargs: Any) -> HookResult | None:
    """The first non-``None`` answer to a firstresult hook, latest registered plugin first."""
    return get_manager().collect_first(hook_name, **kwargs)


def plugin_records() -> list[PluginRecord]:
    """Every plugin seen, in load order, with its status (including disabled and failed ones)."""
    return list(get_manager().records)
