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
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import time
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from qplug_core import hookspecs
from qplug_core.errors import PluginContractError, PluginError, PluginHookError, PluginLoadError

ENTRY_POINT_GROUP = "qplug"
CORE_DISTRIBUTION = "qplug-core"

#: Built-in plugins: name -> module, loaded before entry points and always (QPLUG_LOAD_PLUGINS only
#: filters entry points), so that the core's own backend is assembled exactly like a third party's.
DEFAULT_PLUGINS: dict[str, str] = {"reference": "qplug_core.reference_backend"}

ENV_LOAD = "QPLUG_LOAD_PLUGINS"
ENV_DISABLE = "QPLUG_DISABLE_PLUGINS"
ENV_STRICT = "QPLUG_STRICT_PLUGINS"
ENV_TRACE = "QPLUG_TRACE_HOOKS"


class QplugPluginWarning(UserWarning):
    """A plugin was skipped (broken, incompatible, shadowed) or a requested one is missing."""


class PluginStatus(str, Enum):
    OK = "ok"
    BROKEN = "broken"
    CONFLICT = "conflict"
    DISABLED = "disabled"
    INCOMPATIBLE = "incompatible"


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
                "error": str(self.error) if self.error else None}


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

    Importing them all up front would import torch (kernels) just to check a backend list.
    """

    _WHERE = {"BackendSpec": "qplug_core.backend", "Diagnostic": "qplug_core.backend",
              "BackendPatternConfig": "qplug_core.config", "QConfigMapping": "qplug_core.config",
              "KernelSpec": "qplug_core.kernels.base", "Delegate": "qplug_core.delegation"}

    def __missing__(self, key: str) -> Any:
        if key == "Pattern":
            return _PatternAnnotation
        if key in self._WHERE:
            return getattr(importlib.import_module(self._WHERE[key]), key)
        raise KeyError(key)


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
    candidates = [Candidate(PluginRecord(name, CORE_DISTRIBUTION, version, module=module, builtin=True),
                            lambda module=module: importlib.import_module(module))
                  for name, module in DEFAULT_PLUGINS.items()]
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
        self._loaded = False

    # -- loading -----------------------------------------------------------------------------------

    def load(self) -> None:
        """Import and register the plugins :func:`plan` selects (once)."""
        if self._loaded:
            return
        self._loaded = True
        candidates, missing = plan()
        for candidate in candidates:
            record = candidate.record
            self.records.append(record)
            if record.error is not None:
                self._announce(record)
            elif record.status is PluginStatus.OK:
                self._register(candidate)
        for name in missing:
            self._warn(f"plugin {name!r} could not be found (named in {ENV_LOAD})")

    def _register(self, candidate: Candidate) -> None:
        """Import one plugin and register its hooks; any failure only marks this plugin broken."""
        record = candidate.record
        self._by_name[record.name] = record
        try:
            plugin = candidate.load()
            self.pm.register(plugin, name=record.name)
        except (Exception, SystemExit) as exc:  # KeyboardInterrupt still stops the program
            self._reject(record, PluginStatus.BROKEN, _load_error(record, exc))
            return
        unknown = [caller.name for caller in self.pm.get_hookcallers(plugin) or ()
                   if not caller.has_spec() and any(
                       impl.plugin is plugin and not impl.optionalhook
                       for impl in caller.get_hookimpls())]
        if unknown:
            self.pm.unregister(plugin)
            self._reject(record, PluginStatus.BROKEN, _load_error(record, pluggy.PluginValidationError(
                plugin, f"unknown hook(s) {', '.join(sorted(unknown))}")))

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
        # warn_explicit with a pseudo location: one line on stderr, no source line underneath.
        warnings.warn_explicit(message, QplugPluginWarning, filename="qplug", lineno=0)

    # -- calling hooks -----------------------------------------------------------------------------

    def _return_type(self, hook_name: str) -> tuple[Any, str]:
        if hook_name not in self._return_types:
            spec = getattr(self.pm.hook, hook_name).spec.function
            resolved = typing.get_type_hints(spec, localns=_AnnotationNamespace())["return"]
            self._return_types[hook_name] = (resolved, spec.__annotations__["return"])
        return self._return_types[hook_name]

    def collect(self, hook_name: str, **kwargs: Any) -> list[HookResult]:
        """Call every implementation of ``hook_name`` in registration order, each in isolation."""
        self.load()
        return [self._call(impl, hook_name, kwargs)
                for impl in getattr(self.pm.hook, hook_name).get_hookimpls()]

    def collect_first(self, hook_name: str, **kwargs: Any) -> HookResult | None:
        """firstresult semantics: the latest registered implementation answering non-``None`` wins."""
        self.load()
        for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls()):
            result = self._call(impl, hook_name, kwargs)
            if result.ok and result.value is not None:
                return result
        return None

    def _call(self, impl: pluggy.HookImpl, hook_name: str, kwargs: dict[str, Any]) -> HookResult:
        record = self._by_name[impl.plugin_name]
        expected, expected_text = self._return_type(hook_name)
        attribution = {**record.attribution(), "hook": hook_name}
        started = time.perf_counter()
        try:
            value = impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
        except Exception as exc:
            error: PluginError = PluginHookError(
                f"plugin {record.label}: hook {hook_name} raised {_one_line(exc)}; disable with "
                f"{ENV_DISABLE}={record.name}", **attribution)
            error.__cause__ = exc
            return self._hook_failed(record, error)
        if self.trace:
            elapsed = (time.perf_counter() - started) * 1000
            print(f"qplug: trace {hook_name}({kwargs}) by {record.label} -> {_describe(value)} "
                  f"in {elapsed:.1f} ms", file=sys.stderr)
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
    """The process-wide manager, loading plugins on first use."""
    global _manager
    if _manager is None:
        _manager = QplugPluginManager()
    _manager.load()
    return _manager


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
