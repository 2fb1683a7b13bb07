"""CPU capability probe: does this x86 CPU have VNNI (int8 dot products without int16 saturation)?

Without VNNI, FBGEMM's ``vpmaddubsw`` saturates int16 pair sums of u8 x s8 products, so the plugin
defaults to ``reduce_range=True`` there. Tests monkeypatch :func:`has_vnni` (or :func:`cpu_flags`).
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
