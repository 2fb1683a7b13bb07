"""qnnpack on x86: QNNPACK's kernels are ARM's, slower than float there; quantize and doctor say so."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import override_cpu_flags

SLOW = "built for ARM"
X86 = {"flags": "avx2 fma avx512f avx512bw avx512_vnni", "machine": "x86_64"}
ARM = {"flags": "asimd asimddp", "machine": "aarch64"}

pytestmark = pytest.mark.slow_here_warning  # each test starts with the warning not given yet


def _mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval(), (torch.randn(2, 16),)


def _slow_warnings(cpu: dict[str, str]) -> list[str]:
    """What qp.quantize (twice) and qp.quantize_dynamic for qnnpack warn about speed on ``cpu``."""
    model, x = _mlp()
    with override_cpu_flags(cpu["flags"], machine=cpu["machine"]), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            qp.quantize(model, x, [x], backend="qnnpack", progress=False)
        qp.quantize_dynamic(model, backend="qnnpack")
    return [str(w.message) for w in caught if SLOW in str(w.message)]


def test_quantizing_for_qnnpack_on_x86_warns_once_naming_the_cost_and_the_x86_backends(qplug_only):
    qplug_only("qplug-qnnpack")
    said = _slow_warnings(X86)
    assert len(said) == 1
    assert said[0].startswith("qplug: backend 'qnnpack' on x86_64: its int8 kernels (QNNPACK) are built for ARM")
    assert "may run slower than float" in said[0] and "use backend fbgemm, onnxruntime or openvino" in said[0]


def test_loading_a_qnnpack_file_on_x86_warns_too(qplug_only, tmp_path):
    """Who deploys a file is often not who quantized it: qp.load says it as quantize does."""
    qplug_only("qplug-qnnpack")
    model, x = _mlp()
    with override_cpu_flags(ARM["flags"], machine=ARM["machine"]):  # quantized on an ARM machine
        path = qp.save(qp.quantize(model, x, [x], backend="qnnpack", progress=False), tmp_path / "m.safetensors")
    with override_cpu_flags(X86["flags"], machine=X86["machine"]), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qp.load(path)
    assert [SLOW in str(w.message) for w in caught].count(True) == 1


def test_quantizing_for_qnnpack_on_arm_says_nothing_about_speed(qplug_only):
    qplug_only("qplug-qnnpack")
    assert _slow_warnings(ARM) == []


@pytest.mark.parametrize("cpu, levels", [(X86, ["ok", "warning"]), (ARM, ["ok"])])
def test_doctor_warns_about_qnnpack_speed_on_x86_only(qplug_only, cpu, levels):
    with override_cpu_flags(cpu["flags"], machine=cpu["machine"]):
        (result,) = qplug_only("qplug-qnnpack").collect("qplug_check_environment", backend="qnnpack",
                                                         plugin="qnnpack")
    findings = result.value
    assert [finding.level for finding in findings] == levels
    if cpu is X86:
        assert SLOW in findings[-1].message and "may run slower than float" in findings[-1].message
        assert findings[-1].hint == "on x86 use backend fbgemm, onnxruntime or openvino; qnnpack is for ARM CPUs"
