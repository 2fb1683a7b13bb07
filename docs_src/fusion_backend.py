"""The tiny_conv backend's fusion at both capture levels, then saved and loaded."""

import tempfile
from pathlib import Path

import torch
from torch import nn

import qplug_core as qp


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3)

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(x)))


torch.manual_seed(0)
model = Net().eval()
example = (torch.randn(2, 3, 8, 8),)
calibration = [torch.randn(4, 3, 8, 8) for _ in range(4)]
for capture in ("symbolic", "export"):  # torch.export: the relu is an aten node, matched as F.relu
    qmodel = qp.quantize(model, example, calibration, backend="tiny_conv", capture=capture)
    kernels = sorted(qp.quantization_report(qmodel).kernels.values())
    print(capture, kernels)  # ['tiny_conv::conv2d', 'tiny_conv::conv2d_relu']
    assert kernels == ["tiny_conv::conv2d", "tiny_conv::conv2d_relu"]

with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "model.safetensors"
    qp.save(qmodel, path)  # the fused ConvReLU is stored by state: FusedModule makes that possible
    loaded = qp.load(path)
assert torch.equal(loaded(*example), qmodel(*example))
print(f"output SQNR {qp.compare(model, loaded, calibration).output_sqnr_db:.1f} dB")
