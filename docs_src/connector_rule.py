"""What stays float and why: the connector rule and the defaults for normalisation and softmax."""

import torch
from torch import nn

import qplug_core as qp


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x, mask):
        h = self.fc3(self.fc1(x) + self.fc2(x))  # add: int8 in, int8 out -> quantized
        scores = torch.softmax(h + mask, dim=-1)  # mask add: feeds no int8 op -> float
        return self.norm(scores)                  # LayerNorm: float in the default mapping


torch.manual_seed(0)
model = Block().eval()
inputs = (torch.randn(2, 16), torch.zeros(2, 16))
data = [inputs] * 2

# recipe="none": no SmoothQuant (which a LayerNorm feeding a Linear calls for, adding its own
# per-channel scale op), so the report shows only what this section is about
qmodel = qp.quantize(model, inputs, data, backend="reference", recipe="none")
report = qp.quantization_report(qmodel)
print(sorted(report.quantized))  # ['add', 'fc1', 'fc2', 'fc3']
for s in report.skipped:
    print(f"{s.node:8} {s.op:10} {s.reason}")
# add_1    add        kept float: its output feeds no int8 op; quantizing it alone would ...
# softmax  softmax    no quantization pattern of the backend matches this op
# norm     LayerNorm  qconfig is None for this op type: qplug's default mapping keeps ...
assert "add" in report.quantized and "add_1" not in report.quantized

# torch.ao's behaviour: quantize every op the qconfig allows, isolated or not.
everything = qp.quantize(model, inputs, data, backend="reference", recipe="none",
                         keep_isolated_ops_float=False)
assert "add_1" in qp.quantization_report(everything).quantized
