"""Quantization-aware training: fake-quantize while fine-tuning, then convert to int8."""

import torch
from torch import nn

import qplug_core as qp

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
example_inputs = (torch.randn(2, 1, 8, 8),)

# Fake-quant observers everywhere, ConvBnReLU2d QAT modules (BN kept, trained), train mode.
mapping = qp.get_default_qconfig_mapping("fbgemm", mode="qat")
prepared = qp.prepare_qat_fx(model, mapping, example_inputs, backend="fbgemm")
print(type(prepared.get_submodule("0")).__name__)  # ConvBnReLU2d

optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
for step in range(5):  # your training loop, unchanged
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    loss = nn.functional.cross_entropy(prepared(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

prepared.eval()
int8 = qp.convert_fx(prepared)
print(qp.quantization_report(int8).kernels)  # {'0': 'quantized::conv2d', '4': 'quantized::linear', ...}
print(int8(torch.randn(2, 1, 8, 8)).shape)
