"""``BackendPlugin``: one backend's hooks as methods, already answering only for that backend.

Every hook is called for every backend, so a module of raw hook functions starts each one with
``if backend != NAME: return []``. A ``BackendPlugin`` subclass instance (named by the entry point,
``mybackend = "qplug_mybackend.plugin:plugin"``) does that filtering once, and gives defaults for the
common case: the shared pattern set with the backend's :class:`DTypeConfigSet`, the torch int8
kernels packed for its engine, and the default qconfig mappings. A backend overrides the plain
methods (``pattern_configs``, ``kernels``, ``qconfig_options``, ``passes``, ...), never the hooks.
Extending *another* backend stays a job for raw ``@hookimpl`` functions.
"""

from __future__ import annotations

import functools
import platform
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from qplug_core.backend_configs.dtype_configs import DTypeConfigSet
from qplug_core.contract import Availability, BackendSpec, Diagnostic, engine_availability
from qplug_core.hookspecs import hookimpl

if TYPE_CHECKING:
    from qplug_core.config import BackendPatternConfig, QConfigMapping
    from qplug_core.delegation import Delegate
    from qplug_core.kernels.base import KernelSpec


class BackendPlugin:
    """Base class of a plugin that registers one backend (see the module docstring).

    Class attributes a subclass sets: ``name`` (required), ``description``, ``engine`` (the
    ``torch.backends.quantized`` engine its kernels pack weights for, ``None`` if none),
    ``machines`` (CPU architectures it runs on, empty for any), ``preferred_machines`` (where it
    is the default backend), and ``dtype_configs`` (``None``: no shared patterns).
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    engine: ClassVar[str | None] = None
    machines: ClassVar[tuple[str, ...]] = ()
    preferred_machines: ClassVar[tuple[str, ...]] = ()
    dtype_configs: ClassVar[DTypeConfigSet | None] = DTypeConfigSet()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not isinstance(getattr(cls, "name", None), str) or not cls.name:
            from qplug_core.errors import ConfigValidationError

            raise ConfigValidationError(f"{cls.__name__} must set the class attribute name = '...'",
                                        field="name", value=getattr(cls, "name", None))

    # -- what a backend overrides ------------------------------------------------------------------

    def is_available(self) -> Availability:
        """Usable where torch has the engine (and the CPU is one of ``machines``)."""
        if self.engine is None:
            return Availability(True)
        return engine_availability(self.engine, machines=self.machines)

    def pattern_configs(self) -> list[BackendPatternConfig]:
        """The patterns this backend quantizes: the shared set with ``dtype_configs``."""
        return [] if self.dtype_configs is None else self.dtype_configs.pattern_configs()

    def kernels(self) -> dict[Any, KernelSpec]:
        """Kernel by complex-format pattern: the torch int8 kernels for ``engine``, if any."""
        if self.engine is None:
            return {}
        from qplug_core.kernels.table import torch_int8_kernels

        return torch_int8_kernels((c.pattern_complex_format for c in self._patterns()), self.engine)

    def qconfig_options(self, mode: str) -> dict[str, Any] | None:
        """Keyword arguments of ``default_qconfig_mapping`` for ``mode``; ``None``: no default."""
        return {}

    def default_qconfig_mapping(self, mode: str) -> QConfigMapping | None:
        options = self.qconfig_options(mode)
        if options is None:
            return None
        from qplug_core.qconfig_defaults import default_qconfig_mapping

        return default_qconfig_mapping(mode, **options)

    def fuser_methods(self) -> dict[Any, Callable]:
        return {}

    def delegate(self) -> Delegate | None:
        """For a runtime that compiles whole int8 partitions (ONNX Runtime, OpenVINO, an NPU
        SDK): which nodes it takes and how a partition is compiled; ``None``: per-op kernels."""
        return None

    def passes(self, stage: str) -> list[Callable]:
        """Graph passes for ``stage`` (a :class:`~qplug_core.enums.Stage` value)."""
        return []

    def check_environment(self) -> list[Diagnostic]:
        """Findings for ``qplug doctor`` beyond the availability the core reports itself."""
        return []

    def is_default_here(self) -> bool:
        """Whether this backend should be picked when the user names none, on this machine."""
        return platform.machine().lower() in self.preferred_machines

    # -- the hooks, answering only for ``name`` ----------------------------------------------------

    @functools.lru_cache(maxsize=None)  # one instance per process: caching on self is fine
    def _patterns(self) -> tuple[BackendPatternConfig, ...]:
        return tuple(self.pattern_configs())

    @hookimpl
    def qplug_register_backends(self) -> list[BackendSpec]:
        return [BackendSpec(self.name, self.description, engine=self.engine,
                            is_available=self.is_available)]

    @hookimpl
    def qplug_backend_pattern_configs(self, backend: str) -> list[BackendPatternConfig]:
        return list(self._patterns()) if backend == self.name else []

    @hookimpl
    def qplug_fuser_methods(self, backend: str) -> dict[Any, Callable]:
        return self.fuser_methods() if backend == self.name else {}

    @hookimpl
    def qplug_int8_kernels(self, backend: str) -> dict[Any, KernelSpec]:
        return self.kernels() if backend == self.name else {}

    @hookimpl
    def qplug_delegate(self, backend: str) -> Delegate | None:
        return self.delegate() if backend == self.name else None

    @hookimpl
    def qplug_default_qconfig_mapping(self, backend: str, mode: str) -> QConfigMapping | None:
        return self.default_qconfig_mapping(mode) if backend == self.name else None

    @hookimpl
    def qplug_passes(self, stage: str, backend: str) -> list[Callable]:
        return self.passes(stage) if backend == self.name else []

    @hookimpl
    def qplug_check_environment(self, backend: str) -> list[Diagnostic]:
        return self.check_environment() if backend == self.name else []

    @hookimpl
    def qplug_select_default_backend(self, available: list[str]) -> str | None:
        return self.name if self.name in available and self.is_default_here() else None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend {self.name!r}>"


__all__ = ["BackendPlugin"]
