"""backend="auto": calibrate once, try every installed backend, keep the fastest correct one."""

import tempfile
from pathlib import Path

import torch
from torch import nn

import qplug_core as qp

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 4)).eval()
data = [torch.randn(1, 3, 16, 16) for _ in range(4)]
qmodel = qp.quantize(model, data[0], data, backend="auto")  # timed on the example inputs

report = qp.quantization_report(qmodel)
print("chosen:", report.backend)
for trial in report.auto:  # every backend tried: status, median on the example inputs, why
    print(f"  {trial['backend']:12} {trial['status']:9} {trial['median_ms'] or 0:7.3f} ms  "
          f"{trial['reason']}")
assert report.backend in {t["backend"] for t in report.auto if t["status"] == "chosen"}

path = qp.save(qmodel, Path(tempfile.mkdtemp()) / "model.safetensors")  # records the ranking
loaded = qp.load(path)  # the chosen backend, or the next fastest installed here, with a warning
x = torch.randn(1, 3, 16, 16)
torch.testing.assert_close(loaded(x), qmodel(x))
