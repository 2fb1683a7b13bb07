"""A Conv-BN-SiLU network (YOLO's C2f/SPPF, EfficientNet) stays int8 between its convs: the SiLU
runs an int8 kernel, so the max-pool and cat behind it stay int8 too, and the result is the
reference form's."""

from __future__ import annotations

import torch
from torch import nn

import qplug_core as qp
from qplug_core.registry import plugins


class SiluBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.SiLU()
        self.pool = nn.MaxPool2d(3, 1, 1)
        self.out = nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn(self.conv(x)))
        return self.out(torch.cat([y, nn.functional.silu(self.pool(y))], 1))


def test_silu_and_the_ops_behind_it_run_int8_and_match_the_reference_form(monkeypatch):
    monkeypatch.setenv(plugins.ENV_LOAD, "qplug-fbgemm")  # fbgemm only: the delegates import slowly
    plugins.reset()
    torch.manual_seed(0)
    model = SiluBlock().eval()
    data = [(torch.randn(1, 3, 12, 12),) for _ in range(4)]
    int8 = qp.quantize(model, data[0], data, backend="fbgemm", progress=False)
    assert [entry.op for entry in qp.quantization_report(int8).skipped if entry.kind == "compute"] == []
    observed = qp.prepare_fx(model, qp.get_default_qconfig_mapping("fbgemm"), data[0], backend="fbgemm")
    for batch in data:
        observed(*batch)
    reference = qp.convert_to_reference_fx(observed)
    x = torch.randn(1, 3, 12, 12)
    with torch.no_grad():
        out, expected = int8(x), reference(x)
    step = (expected.max() - expected.min()) / 255
    assert (out - expected).abs().max() <= 2 * step
