"""Eager convert checks its kernels as graph mode does: each int8 module against its reference
computation on one row of the prepared model's first call, and the whole int8 model against its
reference form. A wrong kernel runs in reference form with a warning; an op called in ``forward()``
that the engine gets wrong (``F.relu6`` on qnnpack: torch 2.13's clamp on channels_last int8
tensors) is no longer silent; right kernels stay, on every backend and CPU, without a word."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp
from qplug_core.analysis import sqnr
from qplug_core.eager import DeQuantStub, FloatFunctional, QuantStub
from qplug_core.kernels.cpu import override_cpu_flags

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")

X = 2 * torch.randn(4, 4, 6, 6, generator=torch.Generator().manual_seed(1))


class Net(nn.Module):
    """conv-bn-relu, a depthwise conv, a ReLU6 module (or ``activation`` called in forward), a
    residual add and a linear layer: every kind of module eager convert swaps."""

    def __init__(self, activation=None) -> None:
        super().__init__()
        self.quant, self.dequant, self.skip = QuantStub(), DeQuantStub(), FloatFunctional()
        self.conv, self.bn, self.relu = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.depthwise, self.relu6 = nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU6()
        self.fc = nn.Linear(8 * 6 * 6, 5)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn(self.conv(self.quant(x))))
        y = self.depthwise(x)
        y = self.relu6(y) if self.activation is None else self.activation(y)
        return self.dequant(self.fc(torch.flatten(self.skip.add(x, y), 1)))


def _observed(backend, activation=None) -> nn.Module:
    torch.manual_seed(0)
    fused = qp.eager.fuse_modules(Net(activation).eval(), [["conv", "bn", "relu"]])
    observed = qp.eager.prepare(fused, backend=backend)
    with torch.no_grad():
        observed(X)
    return observed


def _converted(backend, activation=None, convert_with=None) -> tuple[nn.Module, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = qp.eager.convert(_observed(backend, activation), backend=convert_with)
    return converted, [str(w.message) for w in caught if str(w.message).startswith("qplug:")]


@pytest.mark.parametrize("activation", [F.relu6, lambda t: F.hardtanh(t, 0.0, 6.0), lambda t: torch.clamp(t, 0, 6)],
                         ids=["relu6", "hardtanh", "clamp"])
def test_a_clamp_called_in_forward_on_qnnpack_is_no_longer_silently_wrong(activation):
    converted, messages = _converted("qnnpack", activation)
    with torch.no_grad():
        off = sqnr(_converted("reference", activation)[0](X), converted(X))
    assert off < 20  # torch's clamp on channels_last int8 tensors: still wrong, but said
    assert len(messages) == 1
    assert "engine 'qnnpack'" in messages[0] and "dB SQNR from its reference form" in messages[0]
    assert "relu6" in messages[0] and "nn.ReLU6" in messages[0]  # the fix


class _Negated(nn.Module):
    """A third-party kernel that gets the sign wrong."""

    def __init__(self, kernel: nn.Module) -> None:
        super().__init__()
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel(x)
        return torch.quantize_per_tensor(-out.dequantize(), out.q_scale(), out.q_zero_point(), out.dtype)


def test_a_wrong_kernel_runs_in_reference_form_with_a_warning_naming_the_module():
    fbgemm = qp.get_backend("fbgemm")
    spec = fbgemm.kernels[nn.Linear]
    wrong = dataclasses.replace(fbgemm, kernels={
        **fbgemm.kernels, nn.Linear: dataclasses.replace(spec, build=lambda ctx: _Negated(spec.build(ctx)))})
    converted, messages = _converted("fbgemm", convert_with=wrong)
    assert len(messages) == 1
    assert "module 'fc'" in messages[0] and "engine 'fbgemm'" in messages[0]
    assert "broke the kernel contract" in messages[0] and "up to" in messages[0]
    assert not isinstance(converted.fc, _Negated)
    with torch.no_grad():
        assert sqnr(_converted("reference")[0](X), converted(X)) > 30


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
@pytest.mark.parametrize("cpu", ["host", "avx2 fma"])
def test_right_kernels_stay_int8_without_a_warning(backend, cpu):
    if cpu == "host":
        converted, messages = _converted(backend)
    else:  # decide as a CPU without VNNI would (7-bit inputs on fbgemm)
        with override_cpu_flags(cpu):
            converted, messages = _converted(backend)
    assert messages == []
    for name in ("conv", "depthwise", "fc"):  # the kernels, not their reference form
        assert not isinstance(converted.get_submodule(name), nn.Sequential), name
    with torch.no_grad():
        assert sqnr(_converted("reference")[0](X), converted(X)) > 25


def test_a_model_that_never_ran_since_prepare_says_its_kernels_went_unchecked():
    calibrated = _observed("fbgemm")
    torch.manual_seed(0)
    fresh = qp.eager.prepare(qp.eager.fuse_modules(Net().eval(), [["conv", "bn", "relu"]]), backend="fbgemm")
    fresh.load_state_dict(calibrated.state_dict())  # observers resumed from a checkpoint
    with pytest.warns(UserWarning, match="were not checked against their reference form: the prepared model never ran"):
        qp.eager.convert(fresh)


class _DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.drop, self.fc2 = nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc2(self.drop(self.fc1(self.quant(x)))))


def test_a_qat_model_converted_in_training_mode_is_checked_as_the_eval_model_it_becomes():
    torch.manual_seed(0)
    trained = qp.eager.prepare_qat(_DropoutNet().train(), backend="fbgemm")
    for _ in range(3):
        trained(torch.randn(8, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = qp.eager.convert(trained)  # a Dropout in training mode raised on int8 tensors
    assert [str(w.message) for w in caught if str(w.message).startswith("qplug:")] == []
    assert not converted.training


def test_a_converted_model_that_cannot_run_its_first_call_says_so_at_convert():
    model = Net().eval()
    model.fc.qconfig = None  # left float, without a DeQuantStub in front: int8 tensors reach it
    observed = qp.eager.prepare(model, backend="fbgemm")
    with torch.no_grad():
        observed(X)
    with pytest.warns(UserWarning, match=r"which its reference form runs \(ModelStateError: module 'fc' "):
        qp.eager.convert(observed)


class _Streaming(nn.Module):
    """Keeps the last frame it saw and counts frames in buffers, and reads a dict input it writes into."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant, self.fc = QuantStub(), DeQuantStub(), nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(1, 8))
        self.register_buffer("frames", torch.zeros((), dtype=torch.long))

    def forward(self, batch: dict) -> torch.Tensor:
        x = batch["x"]
        batch["seen"] = True  # a model may write into its own input
        out = self.dequant(self.fc(self.quant(x))) + self.cache
        self.cache.copy_(x[-1:].detach())
        self.frames += x.shape[0]
        return out


def test_the_check_leaves_a_stateful_model_as_calibration_left_it_and_replays_a_writable_call():
    """(s27 review) the check's two runs wrote the streaming state of the model convert returned
    (with inplace=True, the user's model); and it replayed the first call as torch.fx's read-only
    dict, so a model writing into its input was 'an example that does not fit', its kernels unchecked."""
    torch.manual_seed(0)
    observed = qp.eager.prepare(_Streaming().eval(), backend="fbgemm")
    with torch.no_grad():
        observed({"x": torch.randn(4, 8)})
        observed.cache.zero_()
        observed.frames.zero_()  # the stream reset before convert
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = qp.eager.convert(observed)
    assert [str(w.message) for w in caught if str(w.message).startswith("qplug:")] == []
    assert int(converted.frames) == 0 and not converted.cache.any()
