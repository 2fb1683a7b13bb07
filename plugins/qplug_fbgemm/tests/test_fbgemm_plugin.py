"""The installed qplug-fbgemm distribution is discovered through its entry point and assembled."""

from __future__ import annotations

import platform

import pytest
import torch

import qplug_core as qp
from qplug_core.plugin_api import X86_MACHINES

from qplug_fbgemm import cpu


@pytest.fixture
def session(qplug_only):
    return qplug_only("qplug-fbgemm")


def test_entry_point_is_loaded(session):
    record = session.record("fbgemm")
    assert (record.dist, record.status, record.module) == ("qplug-fbgemm", "ok", "qplug_fbgemm.plugin:plugin")


def test_backend_is_listed_with_real_availability(session):
    info = next(i for i in qp.list_backends() if i.name == "fbgemm")
    expected = ("fbgemm" in torch.backends.quantized.supported_engines
                and platform.machine().lower() in X86_MACHINES)
    assert info.available is expected
    assert info.n_pattern_configs == 203 and info.engine == "fbgemm"
    assert qp.get_backend("fbgemm").engine == "fbgemm"


@pytest.mark.skipif(platform.machine().lower() not in X86_MACHINES, reason="x86 only")
def test_is_the_default_backend_on_x86(session):
    assert qp.get_backend().name == "fbgemm"


def test_cpuinfo_flags_are_parsed(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512_vnni\n\nprocessor\t: 1\n")
    assert cpu.VNNI_FLAGS & cpu.cpu_flags(cpuinfo) == {"avx512_vnni"}
    assert cpu.cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize("vnni, level, quant_max", [(True, "ok", 255), (False, "warning", 127)])
def test_cpu_decides_doctor_finding_and_activation_range(session, monkeypatch, vnni, level, quant_max):
    monkeypatch.setattr(cpu, "has_vnni", lambda: vnni)
    (result,) = session.collect("qplug_check_environment", backend="fbgemm", plugin="fbgemm")
    assert [d.level for d in result.value] == [level]
    activation = qp.get_default_qconfig_mapping("fbgemm").global_qconfig.activation()
    assert activation.quant_max == quant_max
