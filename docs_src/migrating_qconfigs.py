"""torch.ao's qconfig helpers and a custom BackendConfig, spelled with qplug's names."""

import torch
from torch import nn

import qplug_core as qp
from qplug_core.observers import MinMaxObserver, PerChannelMinMaxObserver

# get_default_qconfig("fbgemm"): the global qconfig of the backend's default mapping
fbgemm_qconfig = qp.get_default_qconfig_mapping("fbgemm").global_qconfig
print(fbgemm_qconfig.activation, fbgemm_qconfig.weight)

# default_qconfig: min/max activations (7-bit, reduce_range) and per-tensor symmetric weights
default_qconfig = qp.QConfig(
    activation=MinMaxObserver.with_args(reduce_range=True),
    weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric))

# default_per_channel_qconfig: the same with one weight scale per output channel
default_per_channel_qconfig = qp.QConfig(
    activation=MinMaxObserver.with_args(reduce_range=True),
    weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                              qscheme=torch.per_channel_symmetric))

# prepare_fx(..., backend_config=my_config): a backend with another BackendConfig. Here fbgemm
# quantizing only linear layers (and their ReLU fusions); everything else stays float.
fbgemm = qp.get_backend("fbgemm")
only_linear = qp.BackendConfig("fbgemm-linear-only")
for config in fbgemm.config.configs:
    if "Linear" in repr(config.pattern_complex_format):
        only_linear.set_backend_pattern_config(config)
linear_backend = fbgemm.with_config(only_linear)

model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 10), nn.ReLU()).eval()
example = (torch.randn(1, 3, 8, 8),)
mapping = qp.QConfigMapping().set_global(default_per_channel_qconfig)
observed = qp.prepare_fx(model, mapping, example, backend=linear_backend)
qp.calibrate(observed, [torch.randn(4, 3, 8, 8) for _ in range(4)])
qmodel = qp.convert_fx(observed)
report = qp.quantization_report(qmodel)
print(report.quantized)  # only the Linear (+ReLU) region is int8
assert list(report.quantized.values()) == ["LinearReLU"]
assert any(skipped.node == "0" for skipped in report.skipped)  # the conv stayed float, with a reason
