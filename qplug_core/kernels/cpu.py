"""What this x86 CPU can do for int8: does it have VNNI (u8 x s8 dot products into int32)?

Without VNNI, the int8 kernels of FBGEMM and oneDNN (behind OpenVINO's CPU plugin) add pairs of
u8 x s8 products with ``vpmaddubsw``, which saturates at int16 (255 * 127 * 2 > 32,767); a backend
keeps one operand in 7 bits there. One probe for every plugin; tests monkeypatch :func:`has_vnni`
(or call :func:`cpu_flags` with their own cpuinfo file).
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where /proc/cpuinfo does not exist)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    return frozenset(flags)


def has_vnni() -> bool:
    return bool(cpu_flags() & VNNI_FLAGS)
