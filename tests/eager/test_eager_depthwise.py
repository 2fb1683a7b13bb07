"""Eager mode on fbgemm with a depthwise conv: eager prepare runs fbgemm's 7-bit depthwise rule on
the conv's input observer, and convert requantizes the conv's input to it, so fbgemm's kernel (whose
int16 pair sums saturate on 8-bit inputs) runs it exactly. A model prepared for another backend
brings 8-bit inputs: the kernel refuses them and the conv runs in reference form, with a warning."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.analysis import sqnr
from qplug_core.eager import DeQuantStub, QuantStub
from qplug_core.observers import MinMaxObserver, PerChannelMinMaxObserver

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class DepthwiseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.relu = nn.ReLU()
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.fc = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.depthwise(self.relu(self.conv(self.quant(x))))
        return self.dequant(self.fc(torch.flatten(x, 1)))


def _converted(backend: str, prepared_for: str | None = None, mapping: qp.QConfigMapping | None = None
               ) -> nn.Module:
    torch.manual_seed(0)
    model = DepthwiseNet().eval()
    with torch.no_grad():
        model.depthwise.weight.abs_()  # positive weights on non-negative inputs: pairs add up
    fused = qp.eager.fuse_modules(model, [["conv", "relu"]])
    observed = qp.eager.prepare(fused, mapping, backend=prepared_for or backend)
    with torch.no_grad():
        for seed in range(4):
            observed(torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(seed)))
    return qp.eager.convert(observed, backend=backend)


def _depthwise_input_integers(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The integers fbgemm's depthwise kernel receives."""
    seen = []
    kernel = model.depthwise.kernel
    handle = kernel.register_forward_pre_hook(lambda module, args: seen.append(args[0].int_repr()))
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen[0]


def test_a_depthwise_conv_prepared_for_fbgemm_runs_on_its_kernel_with_7_bit_inputs(recwarn):
    on_fbgemm = _converted("fbgemm")
    assert [str(w.message) for w in recwarn if str(w.message).startswith("qplug: ")] == []
    reference = _converted("reference")
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(9))
    assert int(_depthwise_input_integers(on_fbgemm, x).max()) <= 127
    with torch.no_grad():
        assert float(sqnr(reference(x), on_fbgemm(x))) > 30  # ~20 dB when the kernel ran saturated


def test_an_explicit_8_bit_observer_made_7_bit_for_a_depthwise_conv_is_reported():
    """As in graph mode: a user who asked 8 bits is told once, naming the module and why."""
    qconfig = qp.QConfig(activation=MinMaxObserver.with_args(reduce_range=False),
                         weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                                                   qscheme=torch.per_channel_symmetric))
    with pytest.warns(UserWarning, match=r"qplug: fbgemm gave the input of 1 layer\(s\) 7 bits \(codes 0\.\.127\) "
                                         r"where your qconfig asks 8 \(0\.\.255\): 'depthwise'\. Why \(fbgemm's prepare "
                                         r"pass limit_depthwise_input_range\): fbgemm's depthwise kernels") as caught:
        _converted("fbgemm", mapping=qp.QConfigMapping().set_global(qconfig))
    assert sum("gave the input of" in str(w.message) for w in caught) == 1


def test_the_backends_own_7_bit_depthwise_inputs_are_not_reported_when_written_out(recwarn):
    _converted("fbgemm", mapping=qp.get_default_qconfig_mapping("fbgemm"))
    assert not [w for w in recwarn if "gave the input of" in str(w.message)]


def test_a_depthwise_conv_prepared_for_another_backend_runs_in_reference_form_with_a_warning():
    with pytest.warns(UserWarning, match=r"backend 'fbgemm': kernel quantized::conv2d refused a Conv2d: .*"
                                         r"it runs in reference form between a dequantize and a quantize"):
        on_fbgemm = _converted("fbgemm", prepared_for="qnnpack")
    reference = _converted("reference")
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert float(sqnr(reference(x), on_fbgemm(x))) > 35


def test_a_qat_depthwise_conv_on_fbgemm_trains_on_the_7_bit_inputs_its_kernel_gets():
    """Training sees what convert runs: the QAT model fake-quantizes the depthwise conv's input to
    the 7-bit qparams convert requantizes it to (34.8 dB apart when training saw 8 bits)."""
    torch.manual_seed(0)
    model = DepthwiseNet()
    with torch.no_grad():
        model.depthwise.weight.abs_()
    qat = qp.eager.prepare_qat(qp.eager.fuse_modules(model.train(), [["conv", "relu"]], is_qat=True),
                               backend="fbgemm")
    optimizer = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for seed in range(6):
        loss = qat(torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(seed))).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert bool(qat.conv.weight.grad.abs().sum() > 0)  # gradients pass the fake-quantized input
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(9))
    qat.eval()
    with torch.no_grad():
        trained = qat(x)
        converted = qp.eager.convert(qat, backend="fbgemm")
        assert int(_depthwise_input_integers(converted, x).max()) <= 127
        torch.testing.assert_close(converted(x), trained, atol=1e-6, rtol=0)
