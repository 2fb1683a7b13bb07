"""Static PTQ step by step: fuse -> prepare -> calibrate -> convert, with a custom QConfigMapping."""

import torch
from torch import nn

import qplug_core as qp
from qplug_core.observers import MinMaxObserver, PerChannelMinMaxObserver


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.features(x).mean(dim=(2, 3))
        return self.head(x)


torch.manual_seed(0)
model = Net().eval()
example_inputs = (torch.randn(1, 3, 16, 16),)
data = [torch.randn(4, 3, 16, 16) for _ in range(4)]

# 1. Fuse (optional: prepare_fx fuses too). Conv-BN-ReLU becomes one ConvReLU2d with BN folded in.
fused = qp.fuse_fx(model, backend="fbgemm")
print(type(fused.get_submodule("features.0")).__name__)  # ConvReLU2d

# 2. Choose qconfigs. Start from the backend's defaults and override; later rules win:
#    global < object type < module-name regex < module name < (module name, type, call index).
mapping = qp.get_default_qconfig_mapping("fbgemm")
mapping.set_module_name("head", None)  # None = keep in float
mapping.set_object_type(nn.Conv2d, qp.QConfig(
    activation=MinMaxObserver.with_args(dtype=torch.quint8, quant_min=0, quant_max=127),
    weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                              qscheme=torch.per_channel_symmetric)))

# 3. Prepare: capture, fuse, decide the int8 regions, insert observers. The model is copied.
observed = qp.prepare_fx(model, mapping, example_inputs, backend="fbgemm")

# 4. Calibrate: run representative data through the observers (no gradients).
qp.calibrate(observed, data)

# 5. Convert. convert_to_reference_fx gives q/dq around float ops (runs anywhere);
#    convert_fx lowers to the backend's int8 kernels.
reference = qp.convert_to_reference_fx(observed)
int8 = qp.convert_fx(observed)  # backend=None: the one the model was prepared for

report = qp.quantization_report(int8)
print(report.kernels)
for skipped in report.skipped:
    print(f"float: {skipped.node} ({skipped.op}): {skipped.reason}")
assert any(s.op == "Linear" for s in report.skipped)  # `head` stayed float, as asked
x = torch.randn(2, 3, 16, 16)
print(qp.sqnr(reference(x), int8(x)))  # reference form vs kernels: same maths, high SQNR
