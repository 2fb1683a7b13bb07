"""A delegating backend's report lists the float ops inside its compiled partitions as fbgemm's
report lists them beside its kernels: a layer the user left float is still float when ONNX Runtime
or OpenVINO runs it (issue 29: MiniLM on openvino said "0 compute ops left in float" with 18
linears float inside the partition)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError
from qplug_core.flows.report import int8_share_line


class ThreeLinears(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.middle, self.last = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))


def _quantized(backend: str, **options):
    mapping = qp.get_default_qconfig_mapping(backend=backend).set_module_name("middle", None)
    calibration = [torch.randn(4, 16, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    return qp.quantize(ThreeLinears().eval(), (torch.randn(4, 16),), calibration, backend=backend,
                       qconfig_mapping=mapping, progress=False, **options)


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_a_float_layer_inside_a_compiled_partition_is_listed(plugin_autoload, backend):
    report = qp.quantization_report(_quantized(backend))
    assert len(report.partitions) == 1 and report.partitions[0]["int8_regions"] == 2
    assert [(s.node, s.reason, s.partition) for s in report.skipped] == [
        ("middle", "qconfig is None for this op (not requested)", "delegate_0")]
    assert int8_share_line(report) == "int8: 67% of weights, MACs unknown for 3 op(s) without shapes (1 compute op(s) left in float)"  # 3 equal linears, traced without shapes
    assert "left in float: 1 compute op(s) (1 inside compiled partitions), by reason" in str(report)


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_the_report_reads_as_fbgemms(plugin_autoload, backend):
    """Same model, same mapping: the same float ops and the same int8 share line."""
    delegated, lowered = (qp.quantization_report(_quantized(b)) for b in (backend, "fbgemm"))
    assert ([(s.node, s.op, s.reason) for s in delegated.skipped]  # fbgemm runs it in PyTorch
            == [(s.node, s.op, s.reason) for s in lowered.skipped])
    assert set(delegated.kernels) == set(lowered.kernels) == set(delegated.quantized)


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_strict_refuses_a_float_layer_inside_a_partition(plugin_autoload, backend):
    with pytest.raises(ConfigValidationError, match=r"strict=True but 1 op\(s\) stay float: middle"):
        _quantized(backend, strict=True)
