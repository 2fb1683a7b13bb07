"""Dynamic quantization in graph mode: int8 weights now, activations quantized per batch."""

import torch
from torch import nn

import qplug_core as qp

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).eval()
example_inputs = (torch.randn(1, 64),)

mapping = qp.get_default_qconfig_mapping("fbgemm", mode="dynamic")  # Linear, LSTM, GRU, cells
observed = qp.prepare_fx(model, mapping, example_inputs, backend="fbgemm")
qp.calibrate(observed, [example_inputs])  # dynamic: only weights need observing; one batch does
int8 = qp.convert_fx(observed)

print(qp.quantization_report(int8).kernels)  # {'0': 'quantized::linear', '2': 'quantized::linear'}
print(type(int8.get_submodule("0")).__name__)  # DynamicLinear: float in, float out
x = torch.randn(4, 64)
print(f"{qp.sqnr(model(x), int8(x)):.1f} dB")
