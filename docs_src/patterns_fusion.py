"""A fusion pattern written with F.relu only: qplug uses the config's own fuser method."""

import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp
from qplug_core.config import BackendConfig, BackendPatternConfig
from qplug_core.nn.intrinsic import ConvReLU2d
from qplug_core.registry.backends import Backend, BackendSpec


def fuse_conv_relu(is_qat, conv, relu):
    """Fuser methods take is_qat, then the matched modules in dataflow (simple-format) order.

    ``relu`` arrives as a fresh nn.ReLU() even though the graph calls F.relu.
    """
    return ConvReLU2d(conv, relu)


config = BackendConfig("only-functional-relu").set_backend_pattern_config(
    BackendPatternConfig((nn.Conv2d, F.relu)).set_fuser_method(fuse_conv_relu))
backend = Backend(BackendSpec("only-functional-relu", "a Backend built by hand"), config)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return F.relu(self.conv(x))


model = Net().eval()
fused = qp.fuse_fx(model, backend=backend)
print(fused.meta["qplug_fusions"])  # [FusionRecord(module_name='conv', pattern='F.relu <- Conv2d', ...)]
assert type(fused.conv) is ConvReLU2d
x = torch.randn(1, 3, 4, 4)
torch.testing.assert_close(fused(x), model(x))  # same function, one module
