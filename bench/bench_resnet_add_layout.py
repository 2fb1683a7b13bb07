"""A ResNet-like int8 CNN on fbgemm: qplug with channels-last adds vs copying them to NCHW vs torch.ao.

Run: ``taskset -c 1 python bench/bench_resnet_add_layout.py [--batches 1 64] [--rounds 60]``

The first-session reports' (F17) digits CNN (conv-bn-relu stem, two residual blocks with add-relu,
adaptive average pool, linear; 1x8x8 inputs, random weights) is quantized by qplug and by
torch.ao's ``prepare_fx``/``convert_fx`` with the same qconfig (histogram activations with
reduce_range, per-channel symmetric weights), engine fbgemm, so the int8 models are bit-identical.
qplug's model is timed as shipped ("qplug") and with its int8 add/add_relu copying their operands
to contiguous ("qplug NCHW add", what the kernel did before: 6 copies per forward, and the pool
then ran on NCHW), interleaved with torch.ao's, 1 thread, CPU time (``time.process_time``).
"""

from __future__ import annotations

import time
import types

import torch
from _harness import interleaved, median, quiet, run_models, torch_ao
from torch import nn

import qplug_core as qp
from qplug_core import observers as qo
from qplug_core.kernels.elementwise import _Binary


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu1, self.relu2 = nn.ReLU(), nn.ReLU()
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        y = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(y)) + identity)


class _ResNetLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
        self.layer1, self.layer2 = _Block(16, 16), _Block(16, 32, 2)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(32, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(self.pool(x), 1))


def _nchw_adds(model: nn.Module) -> nn.Module:
    """``model`` with every int8 two-tensor add/mul copying its operands contiguous, as it did before."""
    for module in model.modules():
        if isinstance(module, _Binary):
            def copying(self, a, b):
                return type(self)._tensor_op(a.contiguous(), b.contiguous(), self.scale, self.zero_point)
            module._on_fast_layout = types.MethodType(copying, module)
    return model


def run(name: str, batches: list[int], rounds: int) -> list[list[str]]:
    tq = torch_ao()
    torch.backends.quantized.engine = "fbgemm"
    torch.manual_seed(0)
    model = _ResNetLike().eval()
    calibration = [torch.rand(100, 1, 8, 8) for _ in range(4)]
    qconfig = qp.QConfig(activation=qo.HistogramObserver.with_args(reduce_range=True),
                         weight=qo.PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                                                      qscheme=torch.per_channel_symmetric))
    with quiet():
        prepared = qp.prepare_fx(model, qp.QConfigMapping().set_global(qconfig), (calibration[0][:1],),
                                 backend="fbgemm")
        qp.calibrate(prepared, calibration, progress=False)
        shipped = qp.convert_fx(prepared)
        nchw = _nchw_adds(qp.convert_fx(prepared))
        variants = {"qplug": shipped, "qplug NCHW add": nchw}
        if tq is not None:
            observed = tq.quantize_fx.prepare_fx(model, tq.QConfigMapping().set_global(tq.get_default_qconfig("x86")),
                                                 (calibration[0][:1],))
            for batch in calibration:
                observed(batch)
            variants["torch.ao"] = tq.quantize_fx.convert_fx(observed)
    rows = []
    for batch in batches:
        x = torch.rand(batch, 1, 8, 8, generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            outputs = {n: m(x) for n, m in variants.items()}
            identical = all(torch.equal(outputs["qplug"], y) for y in outputs.values())
            times = interleaved({n: (lambda m=m: m(x)) for n, m in variants.items()}, rounds, warmup=5,
                                clock=time.process_time)
        t = {n: median(ts) for n, ts in times.items()}
        ao = t.get("torch.ao", float("nan"))
        rows.append([name, str(batch), *(f"{t[n] * 1e6:.0f}" for n in ("qplug", "qplug NCHW add")),
                     f"{ao * 1e6:.0f}", f"{t['qplug'] / ao:.2f}", f"{t['qplug NCHW add'] / ao:.2f}", str(identical)])
    return rows


def main() -> None:
    run_models(__doc__, ["resnet_like"], run,
               ["model", "batch", "qplug us", "qplug NCHW add us", "torch.ao us", "qplug/ao", "NCHW add/ao",
                "identical"])


if __name__ == "__main__":
    main()
