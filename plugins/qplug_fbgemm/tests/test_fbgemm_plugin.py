"""The installed qplug-fbgemm distribution is discovered through its entry point and assembled."""

from __future__ import annotations

import platform

import pytest
import torch

import qplug_core as qp
from qplug_core.plugin_api import PAIRS_EXACT, X86_MACHINES, override_cpu_flags, probe_pair_sums

from qplug_fbgemm.plugin import plugin as fbgemm_plugin


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
    # 255: 249 + a @ b, a.matmul(b), torch.bmm, a.bmm(b), torch.mm, a.mm(b)
    assert info.n_pattern_configs == 255 and info.engine == "fbgemm"
    assert qp.get_backend("fbgemm").engine == "fbgemm"


@pytest.mark.skipif(platform.machine().lower() not in X86_MACHINES, reason="x86 only")
def test_is_the_default_backend_on_x86(session):
    assert qp.get_backend().name == "fbgemm"


@pytest.mark.parametrize("flags, level, weight_range", [
    # ok where fbgemm's own kernels are exact on this host (a VNNI CPU); on one without VNNI the
    # set flags still decide the qparams, and the doctor warns that its probe saturated
    ("avx2 avx512f avx512bw avx512_vnni", None, (-128, 127)),
    ("avx2 fma", "warning", (-64, 64)),  # pairs of u8 x s8 products saturate at int16 here
])
def test_cpu_decides_doctor_finding_and_qparams(session, flags, level, weight_range):
    if level is None:
        exact = probe_pair_sums(fbgemm_plugin.int8_gemm()) == PAIRS_EXACT
        level = "ok" if exact else "warning"
    with override_cpu_flags(flags):
        (result,) = session.collect("qplug_check_environment", backend="fbgemm", plugin="fbgemm")
        assert [d.level for d in result.value] == [level]
        qconfig = qp.get_default_qconfig_mapping("fbgemm").global_qconfig
    weight, activation = qconfig.weight(), qconfig.activation()
    assert (weight.quant_min, weight.quant_max) == weight_range
    assert activation.quant_max == 255
