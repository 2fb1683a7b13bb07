"""Backends: what a plugin declares (:class:`BackendSpec`) and what the flows use (:class:`Backend`).

A backend is assembled from the contributions of *every* plugin (pattern configs, fuser methods,
kernels), not only the one that registered it, so that a vendor can extend ``fbgemm`` with one
pattern. Assembly happens once per plugin manager (see :func:`qplug_core.registry.plugins.reset`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator

from qplug_core.config import BackendConfig, names
from qplug_core.enums import MODES, STAGES, BackendStatus, PluginStatus
from qplug_core.errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    ConfigError,
    ConfigValidationError,
    DuplicateBackendError,
    DuplicatePatternError,
    PluginError,
    QplugError,
    did_you_mean,
    notify,
    spelled,
    warn_user,
)
from qplug_core.kernels.arithmetic import Int8Arithmetic, backend_arithmetic, engine_arithmetic
from qplug_core.kernels.base import DEQUANTIZE_KEY, QUANTIZE_KEY
from qplug_core.kernels.cpu import cpu_int8
from qplug_core.patterns import format_pattern, to_complex_format
from qplug_core.registry import plugins
from qplug_core.registry.contract import (  # re-exported: the registry's callers import them from here
    ARM_MACHINES,
    X86_MACHINES,
    Availability,
    BackendSpec,
    Delegate,
    Diagnostic,
    engine_availability,
    platform_name,
)

if TYPE_CHECKING:
    from qplug_core.config import BackendConfig, QConfigMapping
    from qplug_core.kernels.base import KernelSpec

__all__ = [
    "ARM_MACHINES", "MODES", "STAGES", "X86_MACHINES", "Availability", "Backend", "BackendInfo",
    "BackendSpec", "Diagnostic", "engine_availability", "environment_diagnostics", "get_backend",
    "list_backends", "platform_name", "resolve_backend",
]

@dataclass
class Backend:
    """A backend assembled from all plugins: what prepare/convert/lowering consult."""

    spec: BackendSpec
    config: BackendConfig
    fuser_methods: dict[Any, Callable] = field(default_factory=dict)
    kernels: dict[Any, KernelSpec] = field(default_factory=dict)
    #: plugins that registered or extended this backend (the registering one first)
    contributors: list[plugins.PluginRecord] = field(default_factory=list)
    #: hook failures of contributing plugins; their contributions are left out (those of the
    #: registering plugin break the backend: see :attr:`status`)
    problems: list[PluginError] = field(default_factory=list)
    #: which plugin contributed each kernel (warnings about a kernel name it)
    kernel_plugins: dict[Any, plugins.PluginRecord] = field(default_factory=dict)
    #: which plugin contributed each pattern config and each fuser method (errors name it)
    config_plugins: dict[Any, plugins.PluginRecord] = field(default_factory=dict)
    fuser_plugins: dict[Any, plugins.PluginRecord] = field(default_factory=dict)
    #: the compiling runtime's contribution (``qplug_delegate``), or ``None``
    delegate: Delegate | None = None
    #: what is wrong with the plugins' contributions but does not break the backend (a kernel
    #: keyed by no pattern config): warned at assembly, shown by ``qplug doctor``
    notes: list[str] = field(default_factory=list)
    #: stage -> the plugins' passes as (plugin label, pass), or the hook failure to raise when the
    #: flow reaches that stage (the flows guard each pass with its label: annotation_guard)
    stage_passes: dict[str, list[tuple[str, Callable]] | PluginError] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def description(self) -> str:
        return self.spec.description

    @property
    def engine(self) -> str | None:
        """The quantized engine kernels must be packed under (see ``kernels.engine_context``)."""
        return self.spec.engine

    @property
    def arithmetic(self) -> Int8Arithmetic:
        """How the kernels accumulate int8 products here (decides which qparams are safe): as
        declared, or measured where the flags call them exact (``kernels_arithmetic``)."""
        return backend_arithmetic(self.name, self.spec.arithmetic or engine_arithmetic(self.engine),
                                  self.spec.int8_gemm)

    @property
    def pairs_in_torch_order(self) -> bool:
        """Whether the core's emulation of the kernels' int16 pair sums holds (see BackendSpec)."""
        return self.spec.pairs_in_torch_order

    @property
    def float_outputs(self) -> frozenset[str]:
        """The kinds of weighted op (``"linear"``, ``"conv"``) that keep a float output where no
        int8 op reads it; empty where every one quantizes its output (see BackendSpec)."""
        return self.spec.float_outputs

    def availability(self) -> Availability:
        try:
            return self.spec.is_available()
        except Exception as exc:  # a probe that crashes means "not usable here", with the reason
            return Availability(False, f"availability check raised {type(exc).__name__}: {exc}")

    def with_config(self, config: BackendConfig) -> Backend:
        """This backend with another BackendConfig (torch.ao's ``backend_config=``): the same
        kernels, fuser methods and engine, matched against ``config``'s patterns. Patterns the
        backend has no kernel for run in reference form, as usual."""
        if not isinstance(config, BackendConfig):
            raise ConfigValidationError(f"with_config needs a BackendConfig, got "
                                        f"{type(config).__name__}", field="config")
        foreign = _torch_ao_twins(config, self.kernels)
        if foreign:
            warn_user(
                f"qplug: BackendConfig {config.name!r} names torch.ao's {', '.join(foreign)}: backend "
                f"{self.name!r} keys its kernels by qplug's classes of these names (qplug_core.nn.intrinsic), "
                "so those regions would run in reference form; use qplug's classes (and fuser methods "
                "building them)")
        return replace(self, config=config)

    def require_available(self) -> Backend:
        """Return ``self``, or raise :class:`BackendUnavailableError` saying why and what to use."""
        refuse_broken(self)
        availability = self.availability()
        if not availability.ok:
            raise BackendUnavailableError(
                f"backend {self.name!r} cannot run on this machine ({platform_name()}): "
                f"{availability.reason}; use one of: {_usable_names()}", backend=self.name)
        return self

    @property
    def own_problems(self) -> list[PluginError]:
        """Hook failures of the plugin registering this backend: what is left of it is not the
        backend its author wrote (a rejected kernel table leaves every layer in reference form).
        Another plugin's failure only loses that plugin's contribution."""
        owner = self.contributors[0].name if self.contributors else None
        return [problem for problem in self.problems if problem.plugin == owner]

    @property
    def status(self) -> BackendStatus:
        if self.own_problems:
            return BackendStatus.BROKEN
        return BackendStatus.OK if self.availability().ok else BackendStatus.UNAVAILABLE

    def default_qconfig_mapping(self, mode: str = "static") -> QConfigMapping:
        """The backend's default mapping for ``mode`` (``"static"``, ``"qat"`` or ``"dynamic"``).

        Asked of the plugins on each call, not kept at assembly like the rest of a Backend: a
        default depends on this CPU (safe qparams without VNNI; overridable for tests) and may be
        built from another backend's default, which a plugin cannot ask for while backends
        assemble. Each call returns a new mapping, which the caller may edit.
        """
        if mode not in MODES:
            raise ConfigError(f"unknown quantization mode {mode!r}{did_you_mean(mode, MODES)}; "
                              f"use one of {', '.join(MODES)}", field="mode", value=mode)
        result = plugins.collect_first("qplug_default_qconfig_mapping", backend=self.name, mode=mode)
        if result is None:
            raise ConfigError(f"no plugin provides a default {mode!r} qconfig mapping for backend "
                              f"{self.name!r}; pass a QConfigMapping explicitly",
                              field="mode", value=mode)
        mapping = result.value
        self._request_only_claimed(mapping, mode)
        return mapping

    def _request_only_claimed(self, mapping: QConfigMapping, mode: str) -> None:
        """Set None the module types the backend claims no int8 form of: in a dynamic mapping those
        without a dynamic dtype config (onnxruntime's nn.GRU), in the others those whose pattern
        has no dtype config (a vendor's DTypeConfigSet without embeddings). A default that
        requested them left them float with a warning the user could not act on."""
        configs = self.config.pattern_to_config()
        for module_type, qconfig in list(mapping.object_type_qconfigs.items()):
            config = configs.get(module_type)
            if mode == "dynamic":
                unclaimed = not any(dc.is_dynamic for dc in (config.dtype_configs if config else []))
            else:
                unclaimed = config is not None and not config.dtype_configs
            if qconfig is not None and unclaimed:
                mapping.set_object_type(module_type, None)

    def passes(self, stage: str) -> list[tuple[str, Callable]]:
        """The plugins' passes for ``stage`` as (plugin label, pass); a plugin whose hook failed
        raises its own PluginError here, where the flow needs them."""
        if stage not in STAGES:
            raise ConfigError(f"unknown stage {stage!r}{did_you_mean(stage, STAGES)}; use one of "
                              f"{', '.join(STAGES)}", field="stage", value=stage)
        found = self.stage_passes.get(stage, [])
        if isinstance(found, PluginError):
            raise found
        return list(found)

    def __repr__(self) -> str:
        return (f"Backend({self.name!r}, engine={self.engine!r}, "
                f"pattern_configs={len(self.config.configs)}, kernels={len(self.kernels)})")


@dataclass(frozen=True)
class BackendInfo:
    """One row of :func:`list_backends` (plain data, JSON-ready through :meth:`to_dict`)."""

    name: str
    status: str
    reason: str = ""
    description: str = ""
    engine: str | None = None
    contributors: tuple[plugins.PluginRecord, ...] = ()
    n_pattern_configs: int = 0
    n_kernels: int = 0

    @property
    def available(self) -> bool:
        return self.status == BackendStatus.OK

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": str(self.status), "available": self.available,
                "reason": self.reason, "description": self.description, "engine": self.engine,
                "plugins": [{"name": r.name, "dist": r.dist, "version": r.version}
                            for r in self.contributors],
                "n_pattern_configs": self.n_pattern_configs, "n_kernels": self.n_kernels}


# -- assembly --------------------------------------------------------------------------------------


@dataclass
class _Entry:
    """A backend name with the plugins registering it and the outcome of assembling it."""

    owners: list[tuple[plugins.PluginRecord, BackendSpec]]
    backend: Backend | None = None
    error: QplugError | None = None


def _disable_hint(*records: plugins.PluginRecord) -> str:
    return " or ".join(f"{plugins.ENV_DISABLE}={r.name}" for r in records)


def _torch_ao_twins(config: BackendConfig, kernels: dict[Any, Any]) -> list[str]:
    """torch.ao classes in ``config`` whose qplug namesakes key ``kernels``: a migrated config's
    ``torch.ao.nn.intrinsic.LinearReLU`` matched, then found no kernel, without a word."""
    keyed = {k.__name__ for k in kernels if isinstance(k, type)}
    named: dict[str, None] = {}
    for cfg in config.configs:
        pattern = cfg.pattern if isinstance(cfg.pattern, tuple) else (cfg.pattern,)
        for cls in (*pattern, cfg.fused_module, cfg.root_module):
            if (isinstance(cls, type) and cls.__module__.startswith("torch.ao.")
                    and cls.__name__ in keyed):
                named[cls.__name__] = None
    return list(named)


def _pattern_key(cfg: Any) -> Any:
    """The complex-format pattern a BackendPatternConfig is filed under by ``BackendConfig``."""
    return next(iter(BackendConfig("_key").set_backend_pattern_config(cfg).pattern_to_config()))


def _claim(owners: dict[Any, plugins.PluginRecord], key: Any, record: plugins.PluginRecord,
           what: str, backend: str) -> None:
    """Give ``key`` to ``record``; a key claimed twice is an error naming both plugins."""
    if key in owners:
        first = owners[key]
        both = (f"both {first.label} and {record.label}" if first is not record
                else f"{record.label} twice")
        raise DuplicatePatternError(
            f"backend {backend!r}: {what} for pattern {format_pattern(key)} is contributed by "
            f"{both}; remove one or disable a plugin with {_disable_hint(first, record)}",
            field=what, value=key)
    owners[key] = record


def _merge(results: list[plugins.HookResult], what: str, backend: Backend,
           owners: dict[Any, plugins.PluginRecord] | None = None) -> dict[Any, Any]:
    owners = {} if owners is None else owners
    merged: dict[Any, Any] = {}
    for result in _usable(results, backend):
        for key, value in result.value.items():
            _claim(owners, key, result.record, what, backend.name)
            merged[key] = value
    return merged


def _usable(results: list[plugins.HookResult], backend: Backend) -> list[plugins.HookResult]:
    """Successful, non-empty results; failures become the backend's problems."""
    usable = []
    for result in results:
        if not result.ok:
            backend.problems.append(result.error)
        elif result.value:
            usable.append(result)
            if result.record not in backend.contributors:
                backend.contributors.append(result.record)
    return usable


def _assemble(record: plugins.PluginRecord, spec: BackendSpec) -> Backend:
    backend = Backend(spec, BackendConfig(spec.name), contributors=[record])
    for result in _usable(plugins.collect("qplug_backend_pattern_configs", backend=spec.name), backend):
        for cfg in result.value:
            _claim(backend.config_plugins, _pattern_key(cfg), result.record, "pattern config", spec.name)
            backend.config.set_backend_pattern_config(cfg)
    backend.fuser_methods = _merge(plugins.collect("qplug_fuser_methods", backend=spec.name),
                                   "fuser method", backend, backend.fuser_plugins)
    backend.kernels = _merge(plugins.collect("qplug_int8_kernels", backend=spec.name),
                             "kernel", backend, backend.kernel_plugins)
    backend.notes = _unused_kernels(backend)
    for note in backend.notes:
        plugins.warn_plugin(note)
    delegate = plugins.collect_first("qplug_delegate", backend=spec.name)
    backend.delegate = None if delegate is None else delegate.value
    backend.stage_passes = {stage: _stage_passes(spec.name, stage) for stage in STAGES}
    return backend


def _unused_kernels(backend: Backend) -> list[str]:
    """A note per kernel keyed by no pattern config of ``backend``: lowering never looks it up, and
    nothing else would say so (a key in the simple format, a typo'd op)."""
    declared = backend.config_plugins  # every config's complex-format pattern
    notes = []
    for key, spec in backend.kernels.items():
        if key in declared or key in (QUANTIZE_KEY, DEQUANTIZE_KEY):
            continue
        try:
            meant = to_complex_format(key)
        except QplugError:
            meant = None
        hint = f"; did you mean {_written(meant)}?" if meant != key and meant in declared else ""
        notes.append(f"plugin {backend.kernel_plugins[key].label}: kernel {spec.op} is keyed by "
                     f"{_written(key)}, which matches no pattern config of backend {backend.name!r}, "
                     f"so it is never used; kernels are keyed by the complex-format pattern (last op "
                     f"first){hint}")
    return notes


def _written(key: Any) -> str:
    """A kernel key as a plugin writes it: ``(ReLU, Linear)``."""
    if isinstance(key, tuple):
        return f"({', '.join(format_pattern(part) for part in key)})"
    return format_pattern(key)


def _stage_passes(backend: str, stage: str) -> list[tuple[str, Callable]] | PluginError:
    found: list[tuple[str, Callable]] = []
    for result in plugins.collect("qplug_passes", stage=stage, backend=backend):
        if not result.ok:
            return result.error
        found.extend((result.record.label, p) for p in result.value)
    return found


def _build_registry() -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for result in plugins.collect("qplug_register_backends"):
        for spec in result.value if result.ok else ():
            entries.setdefault(spec.name, _Entry([])).owners.append((result.record, spec))
    for name, entry in entries.items():
        records = [record for record, _ in entry.owners]
        if len(records) > 1:
            entry.error = DuplicateBackendError(
                f"backend {name!r} is registered by {' and '.join(r.label for r in records)}; "
                f"uninstall one or disable it with {_disable_hint(*records)}",
                backend=name, dists=[r.dist or r.name for r in records])
            continue
        try:
            entry.backend = _assemble(*entry.owners[0])
        except QplugError as exc:
            entry.error = exc
    return entries


def _registry() -> dict[str, _Entry]:
    """Assembled backends, built once per plugin manager (so a reset rebuilds them)."""
    return plugins.get_manager().derived("backends", _build_registry)


# -- public API ------------------------------------------------------------------------------------


def list_backends() -> list[BackendInfo]:
    """Every registered backend with its plugins, sizes and status (ok/unavailable/broken/conflict).

    A name registered by two plugins gives one ``conflict`` row per plugin.
    """
    rows: list[BackendInfo] = []
    for name, entry in _registry().items():
        backend = entry.backend
        if backend is None:
            status = (BackendStatus.CONFLICT if isinstance(entry.error, DuplicateBackendError)
                      else BackendStatus.BROKEN)
            rows += [BackendInfo(name, status, str(entry.error), spec.description, spec.engine, (record,))
                     for record, spec in (entry.owners if status is BackendStatus.CONFLICT else entry.owners[:1])]
            continue
        availability = backend.availability()
        reason = "; ".join(str(p) for p in backend.problems) or availability.reason
        rows.append(BackendInfo(name, backend.status, reason, backend.description, backend.engine,
                                tuple(backend.contributors), len(backend.config.configs),
                                len(backend.kernels)))
    return rows


def _usable_names() -> str:
    return ", ".join(info.name for info in list_backends() if info.status == BackendStatus.OK) or "none"


def refuse_broken(backend: Backend) -> None:
    """Raise :class:`BackendUnavailableError` with the recorded failures of a broken backend."""
    if backend.status is BackendStatus.BROKEN:
        failures = "; ".join(str(problem) for problem in backend.own_problems)
        raise BackendUnavailableError(f"backend {backend.name!r} is broken: {failures}; use one of: "
                                      f"{_usable_names()}", backend=backend.name) from backend.own_problems[0]


def _default_backend_name() -> str:
    available = [info.name for info in list_backends() if info.status == BackendStatus.OK]
    choice = plugins.collect_first("qplug_select_default_backend", available=available)
    if choice is not None:
        if choice.value in available:
            return choice.value
        warn_user(f"plugin {choice.record.label} selected backend {choice.value!r}, which is not "
                  f"available here ({', '.join(available)}); ignoring it", plugins.QplugPluginWarning)
    if "reference" in available or not available:
        return "reference"
    return available[0]


#: the backend name that asks ``qp.quantize`` to measure every installed backend (flows/auto.py)
AUTO = "auto"


def get_backend(name_or_backend: str | Backend | None = None) -> Backend:
    """The assembled backend of that name; ``None`` picks the best available one for this machine
    (the plugins' ``qplug_select_default_backend``, else reference).
    Callers that pick the default tell the user which backend they got.
    """
    if isinstance(name_or_backend, Backend):
        return name_or_backend
    if name_or_backend is not None and not isinstance(name_or_backend, str):
        raise ConfigValidationError(f"backend must be a backend name (a str such as 'fbgemm'), a Backend or "
                                    f"None, got {name_or_backend!r} ({type(name_or_backend).__name__})",
                                    field="backend", value=repr(name_or_backend))
    entries = _registry()
    name = _default_backend_name() if name_or_backend is None else name_or_backend
    entry = entries.get(name)
    if entry is None:
        raise not_a_backend(name)
    if entry.error is not None:
        raise entry.error
    refuse_broken(entry.backend)
    return entry.backend


def resolve_backend(backend: str | Backend | None) -> Backend:
    """The Backend to use; with ``None`` the best one for this machine, announced on stderr."""
    chosen = get_backend(backend)
    if backend is None:
        notify(f"using backend {chosen.name!r} "
               f"({spelled('pass backend=... to choose', 'choose one with --backend NAME')})")
    return chosen


def not_a_backend(name: str) -> QplugError:
    """The error for a backend name no plugin provides; ``"auto"`` (which every caller but
    ``qp.quantize`` gets here) is not a plugin to install but a choice only quantize makes."""
    entries = _registry()
    if name == AUTO:
        auto, quantize = spelled("backend='auto'", "--backend auto"), spelled("qp.quantize", "qplug quantize")
        return ConfigValidationError(
            f"{auto} quantizes on every installed backend and keeps the fastest, which only {quantize} "
            f"does; this works on one backend: name one (installed: {', '.join(entries)}) or leave it "
            "out for this machine's default", field="backend", value=name)
    return BackendNotFoundError(_not_found_message(name, entries), backend=name)


def _not_found_message(name: str, entries: dict[str, _Entry]) -> str:
    """What went wrong and the fix: the loaded backends, near misses, and what metadata knows.

    The hint comes from the installed distributions' own entry points (read without importing
    anything), so the core names no plugin of its own.
    """
    provided = {info.name: info for info in plugins.discover()}
    candidates = [n for n in (*entries, *provided) if n != name]
    message = (f"no backend {name!r}{did_you_mean(name, candidates)}; installed backends: "
               f"{', '.join(entries) or 'none'}")
    skipped = [r for r in plugins.plugin_records() if r.name == name and r.status != PluginStatus.OK]
    if skipped:
        message += f"; plugin {skipped[0].label} is {skipped[0].status.value}"
    elif wanted := next(iter(difflib.get_close_matches(name, [n for n in provided if n not in entries],
                                                       n=1, cutoff=0.6)), None):
        info = provided[wanted]
        message += (f"; {info.dist} {info.version} provides {wanted!r} but is not loaded: add "
                    f"{info.name!r} to {plugins.ENV_LOAD} or unset it")
    elif name in _ENGINE_KERNELS:
        message += _engine_hint(name, entries)
    else:
        message += "; install the plugin distribution that provides it (qplug list-backends --no-load " \
                   "shows what is installed)"
    return message


#: torch quantized engines no qplug backend is named after -> the engines whose kernels they run
#: (torch.ao's "x86" picks FBGEMM's or oneDNN's per op)
_ENGINE_KERNELS = {"x86": ("fbgemm", "onednn"), "onednn": ("onednn",)}


def _engine_hint(name: str, entries: dict[str, _Entry]) -> str:
    """For a torch engine name (torch.ao's ``get_default_qconfig_mapping("x86")``): the backends
    running its kernels."""
    engines = _ENGINE_KERNELS[name]
    on_it = [n for n, e in entries.items() if e.backend is not None and e.backend.engine in engines]
    return (f"; {name!r} is a torch quantized engine (torch.backends.quantized.engine), not a qplug backend"
            + (f": backend {' or '.join(map(repr, on_it))} runs its kernels" if on_it else ""))


def environment_diagnostics() -> list[tuple[str, Diagnostic]]:
    """What ``qplug doctor`` reports, as ``(scope, finding)`` pairs: torch and its engines, the
    health of every plugin, each backend's status and its plugins' ``qplug_check_environment``."""
    import torch

    engines = list(torch.backends.quantized.supported_engines)
    findings = [("torch", Diagnostic("ok", f"torch {torch.__version__} on {platform_name()}")),
                ("cpu", Diagnostic("ok", f"int8: {cpu_int8().summary()}")),
                ("torch", Diagnostic("ok", f"quantized engines {engines}, current "
                                           f"{torch.backends.quantized.engine!r}"))]
    for record in plugins.plugin_records():
        if record.error is not None:
            findings.append((f"plugin {record.name}", Diagnostic("error", str(record.error))))
        else:
            findings.append((f"plugin {record.name}", Diagnostic(
                "ok", f"{record.dist} {record.version or ''} {record.status.value}".rstrip())))
    for info in list_backends():
        level = {BackendStatus.OK: "ok", BackendStatus.UNAVAILABLE: "warning"}.get(info.status, "error")
        message = info.status + (f": {info.reason}" if info.reason else "")
        findings.append((f"backend {info.name}", Diagnostic(level, message)))
        entry = _registry()[info.name]
        findings += [(f"backend {info.name}", Diagnostic("warning", note))
                     for note in (entry.backend.notes if entry.backend is not None else ())]
    for name in dict.fromkeys(info.name for info in list_backends()):
        for result in plugins.collect("qplug_check_environment", backend=name):
            if result.ok:
                findings += [(f"backend {name}", finding) for finding in result.value]
            else:
                findings.append((f"backend {name}", Diagnostic("error", str(result.error))))
    return findings


def _backends_for_names() -> tuple[dict, Iterator[Backend]]:
    """The name table's view of the backends (``config.names`` sits below this layer): the plugin
    manager's cache, cleared on reload, and every backend that assembles."""
    def usable() -> Iterator[Backend]:
        for info in list_backends():
            try:
                yield get_backend(info.name)
            except QplugError:
                continue  # broken or conflicting backends are reported where they are selected
    return plugins.get_manager().cache, usable()


names.set_backend_source(_backends_for_names)
