"""What this CPU can do for int8, read once from the CPU itself: the one place that says so.

Whether int8 kernels are exact, and how fast they are, depends on the instruction set: with VNNI
(``avx512_vnni``, ``avx_vnni``) u8 x s8 products accumulate in int32; without it x86 kernels add
adjacent products with ``vpmaddubsw`` into int16 *with saturation* (2 x 255 x 127 > 32,767), and
oneDNN's int8 GEMMs, which need VNNI to be exact, are not used. ARM's dot-product instructions
(``asimddp``, ``i8mm``) accumulate in int32 too. Backends' default qparams, the per-token dynamic
kernel's GEMM and ``qplug doctor`` all read :func:`cpu_int8`.

The flags come from the CPU itself, as the kernels read them: CPUID through
``torch.cpu.get_capabilities()`` (the cpuinfo library FBGEMM dispatches on; oneDNN and ONNX
Runtime's MLAS read CPUID too). ``/proc/cpuinfo`` can disagree with what the kernels run: under
an emulator it shows the host's flags (``qemu-x86_64 -cpu Haswell`` on a VNNI host lists VNNI while
every int8 kernel takes its saturating AVX2 path). Without that probe (an older torch) the flags
come from ``/proc/cpuinfo`` (Linux), else from ``torch.backends.cpu.get_cpu_capability()`` (e.g.
``AVX512`` or ``AVX2``, which does not name VNNI: treated as without it, the safe side). Tests and
users on a machine they want to model set
``QPLUG_CPU_FLAGS`` (space- or comma-separated flags, e.g. ``"avx2 fma"``) or use
:func:`override_cpu_flags`; both replace what the CPU reports.

Flags say which instructions exist, not which the installed kernels take (FBGEMM and oneDNN can be
held to AVX2 on a VNNI CPU: ``FBGEMM_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``). Where
the *detected* flags say a backend's kernels are exact, its measured product decides
(``kernels/arithmetic.py``, :func:`~qplug_core.kernels.arithmetic.kernels_arithmetic`); flags
that were set win over any measurement, so a test decides as on the CPU it names.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import platform
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: replaces the detected flags (space- or comma-separated) when set
ENV_FLAGS = "QPLUG_CPU_FLAGS"
CPUINFO = Path("/proc/cpuinfo")
#: the source of flags read from the CPU itself
CPUID = "CPUID"
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})
ARM_DOT_FLAGS = frozenset({"asimddp", "i8mm"})
#: torch.cpu.get_capabilities() names that /proc/cpuinfo spells otherwise (the rest are the same)
_CPUID_NAMES = {"avx512_f": "avx512f", "avx512_bw": "avx512bw", "avx512_cd": "avx512cd",
                "avx512_dq": "avx512dq", "avx512_vl": "avx512vl", "fma3": "fma", "bmi": "bmi1",
                "sha": "sha_ni", "dot": "asimddp"}
#: what a CPU can do for int8 that kernels take another code path on (:attr:`CpuInt8.int8_capabilities`),
#: as a file records it -> as users read it
INT8_CAPABILITIES = {"avx2": "AVX2", "avx512": "AVX-512", "vnni": "VNNI", "amx": "AMX", "arm_dot": "ARM dot-product"}
#: torch.backends.cpu.get_cpu_capability() -> the flags it implies
_TORCH_CAPABILITY_FLAGS = {"AVX512": ("avx2", "avx512f", "avx512bw"), "AVX2": ("avx2",),
                           "SVE256": ("sve",)}

#: the innermost override of this thread, (flags, machine or None for the host's) (a context variable:
#: one thread's override, such as the 32-bit-accumulation view weight_bits.mark takes, must not change
#: another thread's decisions)
_override: contextvars.ContextVar[tuple[frozenset[str], str | None] | None] = contextvars.ContextVar(
    "cpu_flags_override", default=None)


@dataclass(frozen=True)
class CpuInt8:
    """What this CPU's instruction set means for int8 kernels (see the module docstring)."""

    flags: frozenset[str]
    #: where the flags came from: "CPUID", "/proc/cpuinfo", "torch", "QPLUG_CPU_FLAGS" or "override"
    source: str
    machine: str

    @property
    def vnni(self) -> bool:
        """u8 x s8 dot products accumulate in int32 (AVX-512 VNNI or AVX-VNNI)."""
        return bool(self.flags & VNNI_FLAGS)

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags and "avx512bw" in self.flags

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_int8" in self.flags

    @property
    def arm_dot(self) -> bool:
        """ARM int8 dot products (``sdot``/``udot``, or ``i8mm``'s matrix multiply) into int32."""
        return bool(self.flags & ARM_DOT_FLAGS)

    @property
    def overridden(self) -> bool:
        """The flags were set (``QPLUG_CPU_FLAGS``, :func:`override_cpu_flags`), not detected: they
        model a CPU, and decisions follow them alone (no measurement of the host's kernels)."""
        return self.source in (ENV_FLAGS, "override")

    @property
    def int8_capabilities(self) -> frozenset[str]:
        """The :data:`INT8_CAPABILITIES` this CPU has: two CPUs that differ here may run one int8
        kernel through different code (VNNI or AVX2 dot products, wider vectors summing in
        another order), so its outputs may differ between them."""
        return frozenset(name for name in INT8_CAPABILITIES if getattr(self, name))

    @property
    def int16_pair_sums(self) -> bool:
        """x86 u8 x s8 products go through ``vpmaddubsw`` (int16 pair sums that saturate)."""
        return self.avx2 and not (self.vnni or self.amx)

    def summary(self) -> str:
        """One line naming what matters, e.g. ``'x86_64: AVX2 without VNNI (int16 pair sums)'``."""
        names = [name for name, has in (("AVX-512", self.avx512), ("AVX2", self.avx2 and not self.avx512),
                                        ("VNNI", self.vnni), ("AMX", self.amx),
                                        ("ARM dot-product", self.arm_dot)) if has]
        text = " + ".join(names) or "no int8 dot-product extensions"
        if self.int16_pair_sums:
            text += " without VNNI (u8 x s8 pair sums saturate at int16)"
        return f"{self.machine}: {text} (flags from {self.source})"


def _parse(text: str) -> frozenset[str]:
    return frozenset(text.replace(",", " ").lower().split())


def read_cpuinfo(cpuinfo: Path = CPUINFO) -> frozenset[str] | None:
    """The feature flags in ``cpuinfo`` (x86 ``flags``, ARM ``Features``); None if unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags)


def read_cpuid() -> frozenset[str] | None:
    """The features CPUID reports (``torch.cpu.get_capabilities()``), named as ``/proc/cpuinfo``
    names them; None where this torch has no such probe."""
    import torch

    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is None:
        return None
    return frozenset(_CPUID_NAMES.get(name, name) for name, value in capabilities().items() if value is True)


def _torch_flags() -> frozenset[str]:
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return frozenset(_TORCH_CAPABILITY_FLAGS.get(capability, ()))


@functools.lru_cache(maxsize=None)
def _detected(env: str | None) -> CpuInt8:
    machine = platform.machine().lower()
    if env is not None:
        return CpuInt8(_parse(env), ENV_FLAGS, machine)
    flags = read_cpuid()
    if flags is not None:
        return CpuInt8(flags, CPUID, machine)
    flags = read_cpuinfo()
    if flags is not None:
        return CpuInt8(flags, str(CPUINFO), machine)
    return CpuInt8(_torch_flags(), "torch", machine)


def cpu_int8() -> CpuInt8:
    """This CPU's int8 facts: the innermost :func:`override_cpu_flags`, else ``QPLUG_CPU_FLAGS``,
    else the CPU's own (read once per process)."""
    override = _override.get()
    if override is not None:
        flags, machine = override
        return CpuInt8(flags, "override", machine or platform.machine().lower())
    return _detected(os.environ.get(ENV_FLAGS))


@contextlib.contextmanager
def override_cpu_flags(flags: Iterable[str] | str, *, machine: str | None = None) -> Iterator[CpuInt8]:
    """Decide as if the CPU reported ``flags`` inside the block (for tests; the kernels that run
    are still the host's). ``override_cpu_flags("avx2 fma")`` models an AVX2 CPU without VNNI;
    ``machine`` (``platform.machine()``'s name, e.g. ``"aarch64"``) models another architecture."""
    token = _override.set((_parse(flags) if isinstance(flags, str) else frozenset(f.lower() for f in flags),
                           None if machine is None else machine.lower()))
    try:
        yield cpu_int8()
    finally:
        _override.reset(token)


__all__ = ["CPUID", "ENV_FLAGS", "INT8_CAPABILITIES", "CpuInt8", "cpu_int8", "override_cpu_flags", "read_cpuid",
           "read_cpuinfo"]
