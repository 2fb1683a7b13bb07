"""A delegate backend that is not ONNX Runtime: int8 Linear (+ReLU) partitions run by numpy.

Needs the example plugin installed: ``pip install -e docs_src/plugin_numpy_int``.
"""

import torch
from torch import nn

import qplug_core as qp

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Sigmoid()).eval()
batches = [torch.randn(4, 16) for _ in range(4)]

qmodel = qp.quantize(model, (batches[0],), batches, backend="numpy_int")
report = qp.quantization_report(qmodel)
print(report)  # int8 share first, then what stayed float and why

# Linear+ReLU was fused and both linears run in one compiled partition; Sigmoid stays in PyTorch
assert [p["module"] for p in report.partitions] == ["NumpyProgram"]
assert list(report.kernels.values()) == ["delegate:delegate_0"] * 2
reference = qp.quantize(model, (batches[0],), batches, backend="reference")
x = torch.randn(4, 16)
print(f"numpy_int vs reference form: SQNR {qp.sqnr(reference(x), qmodel(x)):.1f} dB")
assert qp.sqnr(reference(x), qmodel(x)) > 30
