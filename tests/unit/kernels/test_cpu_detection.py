"""Where ``cpu_int8`` reads the CPU from: CPUID, as the kernels do, before ``/proc/cpuinfo``.

Under ``qemu-x86_64 -cpu Haswell`` on a VNNI host, ``/proc/cpuinfo`` is the host's (VNNI) while
ONNX Runtime's, FBGEMM's and oneDNN's int8 kernels take their saturating AVX2 paths: decisions
read from ``/proc/cpuinfo`` there gave 8-bit weights that those kernels break."""

from __future__ import annotations

import pytest
import torch

from qplug_core.kernels import cpu as cpu_module
from qplug_core.kernels.cpu import CPUID, cpu_int8, read_cpuid

#: what torch.cpu.get_capabilities() reports on an AVX2 CPU without VNNI (names as torch spells them)
HASWELL = {"architecture": "x86_64", "sse4_2": True, "avx": True, "avx2": True, "fma3": True, "bmi": True,
           "avx512_f": False, "avx512_bw": False, "avx512_vnni": False, "avx_vnni": False, "amx_int8": False,
           "l1d_cache_size": 32768, "num_physical_cores": 2}
VNNI_CPUINFO = frozenset("fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx_vnni amx_int8".split())


@pytest.fixture
def detect_afresh(monkeypatch):
    """Detection runs again in this test, with no flags set by the environment."""
    monkeypatch.delenv(cpu_module.ENV_FLAGS, raising=False)
    cpu_module._detected.cache_clear()
    yield monkeypatch
    cpu_module._detected.cache_clear()


def test_cpuid_features_get_the_names_proc_cpuinfo_uses(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: HASWELL)
    assert read_cpuid() == frozenset({"sse4_2", "avx", "avx2", "fma", "bmi1"})


def test_cpuid_wins_over_proc_cpuinfo(detect_afresh):
    detect_afresh.setattr(torch.cpu, "get_capabilities", lambda: HASWELL)
    detect_afresh.setattr(cpu_module, "read_cpuinfo", lambda: VNNI_CPUINFO)
    cpu = cpu_int8()
    assert cpu.source == CPUID and not cpu.vnni and not cpu.avx512 and cpu.int16_pair_sums
    assert cpu.summary().endswith(": AVX2 without VNNI (u8 x s8 pair sums saturate at int16) (flags from CPUID)")


def test_without_torchs_probe_proc_cpuinfo_decides(detect_afresh):
    detect_afresh.delattr(torch.cpu, "get_capabilities")
    detect_afresh.setattr(cpu_module, "read_cpuinfo", lambda: VNNI_CPUINFO)
    cpu = cpu_int8()
    assert cpu.source == "/proc/cpuinfo" and cpu.vnni and cpu.amx and not cpu.int16_pair_sums


def test_the_hosts_vnni_is_what_cpuid_says(detect_afresh):
    capabilities = torch.cpu.get_capabilities()
    vnni = bool(capabilities.get("avx512_vnni") or capabilities.get("avx_vnni"))
    assert cpu_int8().vnni is vnni
    assert cpu_int8().avx2 is bool(capabilities.get("avx2"))
