"""The installed qplug-fbgemm distribution is discovered through its entry point and assembled."""

from __future__ import annotations

import platform

import pytest
import torch

from qplug_core import plugins
from qplug_core.backend import X86_MACHINES, get_backend, list_backends
from qplug_core.testing import all_plugins_loaded, require_distribution

from qplug_fbgemm import cpu

require_distribution("qplug-fbgemm")


@pytest.fixture(autouse=True)
def installed_plugins():
    with all_plugins_loaded():
        yield


def test_entry_point_is_loaded():
    record = next(r for r in plugins.plugin_records() if r.name == "fbgemm")
    assert (record.dist, record.status, record.module) == (
        "qplug-fbgemm", plugins.PluginStatus.OK, "qplug_fbgemm.plugin")


def test_backend_is_listed_with_real_availability():
    info = next(i for i in list_backends() if i.name == "fbgemm")
    expected = ("fbgemm" in torch.backends.quantized.supported_engines
                and platform.machine().lower() in X86_MACHINES)
    assert info.available is expected
    assert info.n_pattern_configs > 0 and info.engine == "fbgemm"
    assert get_backend("fbgemm").engine == "fbgemm"


def test_cpuinfo_flags_are_parsed(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512_vnni\n\nprocessor\t: 1\n")
    assert cpu.VNNI_FLAGS & cpu.cpu_flags(cpuinfo) == {"avx512_vnni"}
    assert cpu.cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize("vnni, level", [(True, "ok"), (False, "warning")])
def test_doctor_reports_vnni(monkeypatch, vnni, level):
    monkeypatch.setattr(cpu, "has_vnni", lambda: vnni)
    (result,) = [r for r in plugins.collect("qplug_check_environment", backend="fbgemm")
                 if r.record.name == "fbgemm"]
    assert [d.level for d in result.value] == [level]
