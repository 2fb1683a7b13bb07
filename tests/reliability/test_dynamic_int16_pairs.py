"""Issue 24: dynamic recurrent layers through ``prepare_fx`` on fbgemm's AVX2 kernels.

Their kernels quantize each of a layer's (already rounded) weight matrices again. They used the full
8-bit range whatever the qconfig said, so on a CPU without VNNI (7-bit weights in the default
mapping there) the weights left the reference form's grid and u8 x s8 pair sums saturated: an LSTM
classifier read 27.0 dB against float where its reference form reads 46.1 (45.99 with the fix).
The kernel check did not see it, because it let every tuple output pass (an LSTM returns
``(output, (h, c))``). FBGEMM's AVX2 kernels are forced (``FBGEMM_ENABLE_INSTRUCTIONS=AVX2``) so
this runs on any x86 CPU.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from qplug_core.flows.kernel_check import output_violation

RUN = """
import json, warnings
import torch
from torch import nn
import qplug_core as qp
from qplug_core.plugin_api import override_cpu_flags
from tests.reliability.test_int16_pair_sums import AVX2, VNNI


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.cell, self.fc = nn.LSTM(16, 32, batch_first=True), nn.GRUCell(32, 24), nn.Linear(24, 10)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(self.cell(out[:, -1]))


g = torch.Generator().manual_seed(1)
data = [(torch.randn(4, 12, 16, generator=g) * 2,) for _ in range(4)]
held_out = torch.randn(8, 12, 16, generator=g) * 2
model = Net().eval()
results = {}
for name, flags in (("avx2", AVX2), ("vnni", VNNI)):
    with override_cpu_flags(flags), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mapping = qp.get_default_qconfig_mapping("fbgemm", mode="dynamic")
        observed = qp.calibrate(qp.prepare_fx(model, mapping, data[0], backend="fbgemm"), data)
        lowered = qp.convert_fx(observed)
    report = qp.quantization_report(lowered)
    with torch.no_grad():
        expected, reference = model(held_out), qp.convert_to_reference_fx(observed)(held_out)
        results[name] = {"kernels": sorted(report.kernels), "fallback": sorted(report.reference.values()),
                         "sqnr": qp.sqnr(expected, lowered(held_out)),
                         "reference_sqnr": qp.sqnr(expected, reference)}
print(json.dumps(results))
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 kernels")
def test_dynamic_recurrent_kernels_keep_the_reference_grid_on_avx2_kernels():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "QPLUG_LOAD_PLUGINS": "qplug-fbgemm",
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, check=True,
                         cwd=root)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    avx2, vnni = result["avx2"], result["vnni"]
    # this CPU's 7-bit weights: every layer runs its kernel, as right as its reference form
    assert avx2["kernels"] == ["cell", "fc", "rnn"] and avx2["fallback"] == []
    assert avx2["sqnr"] >= avx2["reference_sqnr"] - 0.5 and avx2["reference_sqnr"] > 30, avx2
    # a VNNI CPU's 8-bit weights saturate here: the check sees it in the LSTM's tuple output too
    assert "rnn" not in vnni["kernels"] and len(vnni["fallback"]) >= 2, vnni
    assert all("broke the kernel contract" in reason for reason in vnni["fallback"])
    assert vnni["sqnr"] >= vnni["reference_sqnr"] - 0.5, vnni  # and the model stays right


def test_the_kernel_check_compares_each_output_of_a_tuple():
    h, c = torch.linspace(0, 1, 8), torch.linspace(-1, 1, 8)
    reference = (torch.linspace(0, 1, 64), (h, c))
    assert output_violation((reference[0] + 1e-3, (h, c)), reference, None, None) == ""
    off = (reference[0], (h, c + 0.5))  # c 64 steps of its 8-bit grid off
    assert output_violation(off, reference, None, None).startswith("output 1: output 1: 8 of 8 outputs differ")
    assert output_violation((reference[0],), reference, None, None) == \
        "it returned a tuple of 1, expected a tuple of 2"
    assert output_violation(reference[0], reference, None, None) == \
        "it returned Tensor, expected a tuple of 2"
