"""``BackendPlugin``: one backend's hooks as methods, already answering only for that backend.

Every hook is called for every backend, so a module of raw hook functions starts each one with
``if backend != NAME: return []``. A ``BackendPlugin`` subclass instance (named by the entry point,
``mybackend = "qplug_mybackend.plugin:plugin"``) does that filtering once, and gives defaults for the
common case: the shared pattern set with the backend's :class:`DTypeConfigSet`, the torch int8
kernels packed for its engine, and the default qconfig mappings with qparams made safe for its
kernels' arithmetic on this CPU (``qplug_core.kernels.arithmetic``: 7-bit weights where x86 kernels
sum u8 x s8 pairs in int16, on CPUs without VNNI). A backend overrides the plain
methods (``pattern_configs``, ``kernels``, ``weight_only_kernels``, ``qconfig_options``,
``passes``, ...), never the hooks.
Extending *another* backend stays a job for raw ``@hookimpl`` functions.
"""

from __future__ import annotations

import functools
import platform
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from qplug_core.config.dtype_configs import DTypeConfigSet
from qplug_core.errors import ConfigValidationError
from qplug_core.kernels.arithmetic import (
    Int8Arithmetic,
    backend_arithmetic,
    engine_arithmetic,
    safe_qconfig_options,
)
from qplug_core.kernels.limits import within_limits
from qplug_core.kernels.pair_sums_probe import Gemm, torch_engine_gemm
from qplug_core.registry.contract import Availability, BackendSpec, Diagnostic, engine_availability
from qplug_core.registry.cpu_diagnostics import cpu_diagnostic, speed_diagnostics
from qplug_core.registry.hookspecs import hookimpl

if TYPE_CHECKING:
    from qplug_core.config import BackendPatternConfig, QConfigMapping
    from qplug_core.kernels.base import KernelSpec
    from qplug_core.kernels.weight_only import WeightOnlyKernel
    from qplug_core.registry.contract import Delegate


class BackendPlugin:
    """Base class of a plugin that registers one backend (see the module docstring).

    Class attributes a subclass sets: ``name`` (required), ``description``, ``engine`` (the
    ``torch.backends.quantized`` engine its kernels pack weights for, ``None`` if none),
    ``machines`` (CPU architectures it runs on, empty for any), ``preferred_machines`` (where it
    is the default backend), ``dtype_configs`` (``None``: no shared patterns),
    ``int8_arithmetic`` (how its kernels accumulate; ``None``: that of ``engine``'s kernels) and
    ``pairs_in_torch_order`` (False where the runtime picks its own operand layouts) and
    ``float_outputs`` (True where the runtime fuses a weighted op's dequantization into it, or
    the set of op kinds it does this for, e.g. ``{"linear"}``; both in
    :class:`~qplug_core.registry.contract.BackendSpec`).
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    engine: ClassVar[str | None] = None
    machines: ClassVar[tuple[str, ...]] = ()
    preferred_machines: ClassVar[tuple[str, ...]] = ()
    dtype_configs: ClassVar[DTypeConfigSet | None] = DTypeConfigSet.native()
    int8_arithmetic: ClassVar[Int8Arithmetic | None] = None
    #: the kernels take symmetric int8 weights only (zero point 0, range [-q, q]): the defaults
    #: are made so, and a layer quantized otherwise keeps the reference form (``kernels/limits.py``)
    symmetric_weights: ClassVar[bool] = False
    pairs_in_torch_order: ClassVar[bool] = True
    float_outputs: ClassVar[bool | frozenset[str]] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not isinstance(getattr(cls, "name", None), str) or not cls.name:
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

    def weight_only_kernels(self) -> list[WeightOnlyKernel]:
        """Weight-only kernels (int8/int4 weights, float activations) this backend runs."""
        return []

    def qconfig_options(self, mode: str) -> dict[str, Any] | None:
        """Keyword arguments of ``default_qconfig_mapping`` for ``mode``; ``None``: no default."""
        return {}

    def arithmetic(self) -> Int8Arithmetic:
        """How this backend's kernels accumulate int8 products here (decides the safe qparams):
        ``int8_arithmetic`` (or ``engine``'s), measured with :meth:`int8_gemm` where the CPU's
        flags say the kernels are exact (``kernels_arithmetic``)."""
        return backend_arithmetic(self.name, self._declared_arithmetic(), self.int8_gemm)

    def _declared_arithmetic(self) -> Int8Arithmetic:
        return self.int8_arithmetic or engine_arithmetic(self.engine)

    def default_qconfig_mapping(self, mode: str) -> QConfigMapping | None:
        options = self.qconfig_options(mode)
        if options is not None and self.symmetric_weights:
            bound = min(-options.get("weight_quant_min", -128), options.get("weight_quant_max", 127))
            options = {**options, "weight_quant_min": -bound, "weight_quant_max": bound}
        options = safe_qconfig_options(self.arithmetic(), options)
        if options is None:
            return None
        from qplug_core.config.defaults import default_qconfig_mapping

        return default_qconfig_mapping(mode, **options)

    def fuser_methods(self) -> dict[Any, Callable]:
        return {}

    def passes(self, stage: str) -> list[Callable]:
        """Graph passes for ``stage`` (a :class:`~qplug_core.enums.Stage` value)."""
        return []

    def delegate(self) -> Delegate | None:
        """The :class:`Delegate` compiling this backend's int8 partitions (an NPU SDK, an
        integer runtime; docs/plugins/delegates.md), or ``None`` for per-op kernels only."""
        return None

    def check_environment(self) -> list[Diagnostic]:
        """Findings for ``qplug doctor`` beyond the availability the core reports itself."""
        return []

    def int8_gemm(self) -> Gemm | None:
        """This backend's u8 x s8 integer product, which ``qplug doctor`` runs once on the worst
        case for int16 pair sums (``kernels/pair_sums_probe.py``): that of ``engine``'s kernels
        by default; a backend with its own kernels or runtime returns its own, or ``None``
        (the finding then rests on the CPU's flags)."""
        if self.engine is None or not self.is_available().ok:
            return None
        return torch_engine_gemm(self.engine)

    def is_default_here(self) -> bool:
        """Whether this backend should be picked when the user names none, on this machine."""
        return platform.machine().lower() in self.preferred_machines

    # -- the hooks, answering only for ``name`` ----------------------------------------------------

    @functools.lru_cache(maxsize=None)  # one instance per process: caching on self is fine
    def _patterns(self) -> Any:
        """``pattern_configs()`` as a tuple; anything but a list is kept as it is, for the hook's
        return check to name (iterating it here hid it behind a TypeError)."""
        configs = self.pattern_configs()
        return tuple(configs) if isinstance(configs, list) else configs

    @hookimpl
    def qplug_register_backends(self) -> list[BackendSpec]:
        return [BackendSpec(self.name, self.description, engine=self.engine,
                            is_available=self.is_available, arithmetic=self._declared_arithmetic(),
                            pairs_in_torch_order=self.pairs_in_torch_order,
                            float_outputs=self.float_outputs, int8_gemm=self.int8_gemm)]

    @hookimpl
    def qplug_backend_pattern_configs(self, backend: str) -> list[BackendPatternConfig]:
        if backend != self.name:
            return []
        configs = self._patterns()
        return list(configs) if isinstance(configs, tuple) else configs

    @hookimpl
    def qplug_fuser_methods(self, backend: str) -> dict[Any, Callable]:
        return self.fuser_methods() if backend == self.name else {}

    @hookimpl
    def qplug_int8_kernels(self, backend: str) -> dict[Any, KernelSpec]:
        if backend != self.name:
            return {}
        return within_limits(self.kernels(), symmetric_weights=self.symmetric_weights,
                             int16_accumulator=self._declared_arithmetic() is Int8Arithmetic.INT16)

    @hookimpl
    def qplug_weight_only_kernels(self, backend: str) -> list[WeightOnlyKernel]:
        return self.weight_only_kernels() if backend == self.name else []

    @hookimpl
    def qplug_default_qconfig_mapping(self, backend: str, mode: str) -> QConfigMapping | None:
        return self.default_qconfig_mapping(mode) if backend == self.name else None

    @hookimpl
    def qplug_passes(self, stage: str, backend: str) -> list[Callable]:
        if backend != self.name:
            return []
        return self.passes(stage)

    @hookimpl
    def qplug_delegate(self, backend: str) -> Delegate | None:
        return self.delegate() if backend == self.name else None

    @hookimpl
    def qplug_check_environment(self, backend: str) -> list[Diagnostic]:
        if backend != self.name:
            return []
        compiles = type(self).delegate is not BackendPlugin.delegate  # asked without building it
        return [*self.check_environment(),
                cpu_diagnostic(self._declared_arithmetic(), compiles=compiles, gemm=self.int8_gemm()),
                *speed_diagnostics(self.engine)]

    @hookimpl
    def qplug_select_default_backend(self, available: list[str]) -> str | None:
        return self.name if self.name in available and self.is_default_here() else None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend {self.name!r}>"


__all__ = ["BackendPlugin"]
