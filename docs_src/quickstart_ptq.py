"""Static post-training quantization in one call, then the report and a numeric comparison."""

import torch
from torch import nn

import qplug_core as qp


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.relu(self.bn(self.conv(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


torch.manual_seed(0)
model = SmallCNN().eval()
example_inputs = (torch.randn(1, 3, 32, 32),)  # a tuple of positional inputs
calibration_data = [torch.randn(8, 3, 32, 32) for _ in range(8)]  # any iterable of batches

qmodel = qp.quantize(model, example_inputs, calibration_data, backend="fbgemm")
print(qmodel(torch.randn(2, 3, 32, 32)).shape)  # torch.Size([2, 10])

# What happened: fusions, int8 regions, kernels, and every op left in float with the reason.
report = qp.quantization_report(qmodel)
print(report.fusions[0].pattern, "->", report.fusions[0].fused_type)  # ReLU <- BatchNorm2d <- Conv2d -> ConvReLU2d
print(report.kernels)  # {'conv': 'quantized::conv2d', 'pool': 'passthrough', ...}
assert not report.skipped  # nothing stayed float

# How close it is to the float model, layer by layer (SQNR in dB). Compare against the *fused*
# float model so that `conv` (conv+bn+relu after fusion) is paired with the same computation;
# with the example inputs, a model only torch.export captures (Hugging Face) is fused as quantize did.
fused = qp.fuse_fx(model, example_inputs, backend="fbgemm")
comparison = qp.compare(fused, qmodel, calibration_data)
comparison.print()
assert comparison.output_sqnr_db > 30
