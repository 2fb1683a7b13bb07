"""Use the tiny backend after `pip install -e docs_src/plugin_tiny`: list it, quantize with it."""

import torch
from torch import nn

import qplug_core as qp

# 1. qplug found the entry point pip installed, as `qplug list-backends` shows.
tiny = next(info for info in qp.list_backends() if info.name == "tiny")
print(tiny.name, tiny.status, [p["dist"] for p in tiny.to_dict()["plugins"]],
      tiny.n_pattern_configs, "pattern config,", tiny.n_kernels, "kernel")
assert tiny.status == "ok" and tiny.n_pattern_configs == 1

# 2. Quantize a model with it.
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
example = (torch.randn(2, 16),)
calibration = [torch.randn(8, 16) for _ in range(4)]
qmodel = qp.quantize(model, example, calibration, backend="tiny")

report = qp.quantization_report(qmodel)
print(report.kernels)   # {'0': 'tiny::linear', '2': 'tiny::linear'}
print(report.skipped)   # the ReLU has no pattern in this backend: it runs in float
assert set(report.kernels.values()) == {"tiny::linear"}
print(f"output SQNR {qp.compare(model, qmodel, calibration).output_sqnr_db:.1f} dB")
