"""Eager mode: mark the int8 region with stubs, fuse by name, prepare, calibrate, convert."""

import torch
from torch import nn

import qplug_core as qp
from qplug_core.eager import DeQuantStub, QuantStub


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = QuantStub()  # float -> int8 here
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(8 * 14 * 14, 10)
        self.dequant = DeQuantStub()  # int8 -> float here

    def forward(self, x):
        x = self.quant(x)
        x = self.relu(self.bn(self.conv(x)))
        return self.dequant(self.fc(self.flatten(x)))


torch.manual_seed(0)
model = Net().eval()
fused = qp.eager.fuse_modules(model, [["conv", "bn", "relu"]])  # BN folded into the conv
observed = qp.eager.prepare(fused, backend="fbgemm")
with torch.no_grad():
    for _ in range(4):
        observed(torch.randn(8, 3, 16, 16))
int8 = qp.eager.convert(observed)
print(int8)
x = torch.randn(2, 3, 16, 16)
print(f"{qp.sqnr(model(x), int8(x)):.1f} dB")
