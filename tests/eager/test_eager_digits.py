"""Eager static PTQ and QAT end to end on a CNN trained on scikit-learn's digits, plus the
convert-side errors, qconfig resolution and the FloatFunctional int8 ops."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.analysis.layers import sqnr
from qplug_core.config import QConfig
from qplug_core.eager import DeQuantStub, FloatFunctional, QFunctional, QuantStub, SimulatedOutput
from qplug_core.errors import ConstraintViolationError, UncalibratedObserverError
from qplug_core.kernels import torch_int8 as K
from qplug_core.nn import qat as nnqat
from qplug_core.observers import MinMaxObserver
from qplug_core.zoo.digits import DigitsCNN, accuracy, load_digits_tensors, train_digits_cnn

GROUPS = [["conv1", "bn1", "relu1"], ["conv2", "bn2"], ["conv3", "bn3", "relu3"]]


class EagerDigitsCNN(DigitsCNN):
    """DigitsCNN with int8 boundaries and the residual add written for eager mode."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant, self.skip = QuantStub(), DeQuantStub(), FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.relu1(self.bn1(self.conv1(self.quant(x))))
        x = self.skip.add_relu(self.bn2(self.conv2(identity)), identity)
        x = self.relu3(self.bn3(self.conv3(self.pool(x))))
        return self.dequant(self.fc(torch.flatten(x, 1)))


@pytest.fixture(scope="module")
def digits():
    trained, float_acc = train_digits_cnn()
    model = EagerDigitsCNN()
    model.load_state_dict(trained.state_dict())
    x_train, y_train, x_test, y_test = load_digits_tensors()
    return model.eval(), float_acc, (x_train, y_train, x_test, y_test)


def _calibrate(model: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        for i in range(0, 256, 128):
            model(x[i:i + 128])


def _ptq(model: nn.Module, x_train: torch.Tensor, backend: str) -> tuple[nn.Module, nn.Module]:
    observed = qp.eager.prepare(qp.eager.fuse_modules(model, GROUPS), backend=backend)
    _calibrate(observed, x_train)
    return observed, qp.eager.convert(observed)


@pytest.mark.parametrize("backend", ["reference", "fbgemm"])
def test_ptq_top1_within_one_point_of_float(digits, backend, plugin_autoload):
    model, float_acc, (x_train, _, x_test, y_test) = digits
    before = copy.deepcopy(model.state_dict())
    _, int8 = _ptq(model, x_train, backend)
    int8_acc = accuracy(int8, x_test, y_test)
    print(f"\n{backend}: float top-1 {float_acc:.4f}, eager int8 top-1 {int8_acc:.4f}")
    assert float_acc >= 0.95 and int8_acc >= float_acc - 0.01
    expected = (K.Conv2d, K.Linear, K.Quantize, K.Dequantize, QFunctional) if backend == "fbgemm" \
        else (SimulatedOutput, SimulatedOutput, SimulatedOutput, nn.Identity, FloatFunctional)
    got = tuple(type(getattr(int8, n)) for n in ("conv1", "fc", "quant", "dequant", "skip"))
    assert got == expected
    # the user's model is untouched: same types, weights, no observers or hooks
    assert type(model.conv1) is nn.Conv2d and type(model.skip.activation_post_process) is nn.Identity
    assert not model.conv1._forward_hooks and not hasattr(model, "qplug_eager_state")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fbgemm_kernels_agree_with_the_reference_simulation(digits, plugin_autoload):
    """One calibrated model converted twice: the int8 kernels vs the simulation of the same qparams."""
    model, _, (x_train, _, x_test, _) = digits
    observed, int8 = _ptq(model, x_train, "fbgemm")
    simulated = qp.eager.convert(observed, backend="reference")
    with torch.no_grad():
        out, ref, flt = int8(x_test), simulated(x_test), model(x_test)
        first = int8.conv1(int8.quant(x_test)).dequantize() - simulated.conv1(simulated.quant(x_test))
    print(f"\nSQNR fbgemm vs simulation {sqnr(ref, out):.1f} dB, vs float {sqnr(flt, out):.1f} dB")
    assert first.abs().max() <= int8.conv1.scale * 1.001  # one layer: within 1 LSB (G7)
    assert sqnr(ref, out) > 35  # 1-LSB requantization differences compound over 5 layers
    assert (out.argmax(1) == ref.argmax(1)).float().mean() >= 0.99


def test_qat_is_at_least_as_good_as_ptq(digits, plugin_autoload):
    model, _, (x_train, y_train, x_test, y_test) = digits
    ptq_acc = accuracy(_ptq(model, x_train, "fbgemm")[1], x_test, y_test)
    qat = qp.eager.prepare_qat(qp.eager.fuse_modules_qat(copy.deepcopy(model).train(), GROUPS),
                               backend="fbgemm")
    assert type(qat.conv1) is nnqat.ConvBnReLU2d and qat.training
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        optimizer = torch.optim.SGD(qat.parameters(), lr=1e-3, momentum=0.9)
        for idx in torch.randperm(len(x_train), generator=torch.Generator().manual_seed(0)).split(32):
            optimizer.zero_grad()
            nn.functional.cross_entropy(qat(x_train[idx]), y_train[idx]).backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    int8 = qp.eager.convert(qat)
    qat_acc = accuracy(int8, x_test, y_test)
    print(f"\nfbgemm eager PTQ top-1 {ptq_acc:.4f}, QAT (1 epoch) top-1 {qat_acc:.4f}")
    assert type(int8.conv1) is K.Conv2d and not int8.training
    assert qat_acc >= ptq_acc


def test_convert_without_calibration_names_the_modules(digits):
    model = digits[0]
    observed = qp.eager.prepare(qp.eager.fuse_modules(model, GROUPS), backend="reference")
    with pytest.raises(UncalibratedObserverError, match=r"never saw calibration data") as info:
        qp.eager.convert(observed)
    assert {"output of module 'quant'", "output of module 'conv1'", "input of module 'fc'",
            "output of module 'skip'"} <= set(info.value.nodes)


def test_qconfig_attributes_take_precedence_over_the_mapping(digits):
    """torch.ao migration: model.qconfig propagates to children; a child's None opts it out."""
    model = qp.eager.fuse_modules(digits[0], GROUPS)
    custom = QConfig(activation=MinMaxObserver, weight=MinMaxObserver.with_args(
        dtype=torch.qint8, qscheme=torch.per_tensor_symmetric))
    model.qconfig, model.fc.qconfig, model.skip.qconfig = custom, None, None
    observed = qp.eager.prepare(model, backend="reference")
    assert type(observed.conv1.activation_post_process) is MinMaxObserver
    assert observed.conv1.qconfig == custom and not hasattr(observed.fc, "activation_post_process")
    _calibrate(observed, digits[2][0])
    converted = qp.eager.convert(observed)
    assert type(converted.fc) is nn.Linear and type(converted.conv1) is SimulatedOutput
    assert type(converted.skip.activation_post_process) is nn.Identity


def test_qconfig_the_backend_cannot_honour_is_refused(digits, plugin_autoload):
    model = qp.eager.fuse_modules(digits[0], GROUPS)
    full_range = QConfig(activation=MinMaxObserver, weight=MinMaxObserver.with_args(
        dtype=torch.qint8, qscheme=torch.per_tensor_symmetric))  # qnnpack needs [-127, 127]
    model.conv1.qconfig = full_range
    with pytest.raises(ConstraintViolationError, match=r"module 'conv1' \(ConvReLU2d\).*'qnnpack'"):
        qp.eager.prepare(model, backend="qnnpack")


class AllOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.ops = nn.ModuleList(FloatFunctional() for _ in range(7))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = self.quant(a), self.quant(b)
        add, add_relu, mul, mul_relu, cat, add_scalar, mul_scalar = self.ops
        x = cat.cat([add.add(a, b), add_relu.add_relu(a, b), mul.mul(a, b), mul_relu.mul_relu(a, b)], 1)
        return self.dequant(mul_scalar.mul_scalar(add_scalar.add_scalar(x, 0.5), -1.5))


def test_float_functional_int8_ops_match_their_simulation(plugin_autoload):
    torch.manual_seed(0)
    data = [(torch.randn(4, 3), torch.randn(4, 3)) for _ in range(4)]
    observed = qp.eager.prepare(AllOps(), backend="fbgemm")
    with torch.no_grad():
        for batch in data:
            observed(*batch)
        int8 = qp.eager.convert(observed)
        simulated = qp.eager.convert(observed, backend="reference")
        out, ref = int8(*data[0]), simulated(*data[0])
    assert all(type(op) is QFunctional for op in int8.ops)
    scale = float(observed.ops[6].activation_post_process.qparams().scale)
    assert (out - ref).abs().max() <= 2 * scale + 1e-6  # within 2 output LSB
    assert sqnr(AllOps()(*data[0]), out) > 25
