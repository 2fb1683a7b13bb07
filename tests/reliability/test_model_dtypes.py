"""Models qplug used to get silently wrong or crash on at the first call (issue 17): non-float32
models, forwards that mutate their input in place, and one module called twice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp
from qplug_core.errors import ModelStateError

pytestmark = pytest.mark.usefixtures("installed_backends")

BACKENDS = ["reference", "fbgemm", "qnnpack"]
MIN_SQNR_DB = 30.0  # these toy models reach 37-42 dB; the bugs gave 1.9-6.8 dB


def sqnr(expected: torch.Tensor, actual: torch.Tensor) -> float:
    expected, actual = expected.detach(), actual.detach()
    return float(20 * torch.log10(expected.norm() / (expected - actual).norm()))


def batches(n: int = 4, seed: int = 0, shape: tuple[int, ...] = (4, 8)) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=gen),) for _ in range(n)]


def check_quantized_matches_float(model: nn.Module, backend: str) -> qp.QuantizationReport:
    """Quantize ``model``; its int8 form must track the float model on fresh inputs."""
    data = batches()
    quantized = qp.quantize(model, data[0], [(x.clone(),) for (x,) in data], backend=backend,
                            progress=False)
    for (x,) in batches(2, seed=5):
        expected = model(x.clone())
        assert sqnr(expected, quantized(x.clone())) >= MIN_SQNR_DB
    return qp.quantization_report(quantized)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64],
                         ids=["float16", "bfloat16", "float64"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_float32_model_gets_a_clear_error_at_quantize_time(dtype, backend):
    torch.manual_seed(0)
    model = Tiny().eval().to(dtype)
    data = [(x.to(dtype),) for (x,) in batches(shape=(2, 3, 8, 8))]
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ModelStateError, match=f"the model's parameter 'conv.weight' is {name}; qplug "
                                              f"quantizes float32 models: quantize model.float()"):
        qp.quantize(model, data[0], data, backend=backend)
    with pytest.raises(ModelStateError, match=f"is {name}"):
        qp.prepare_fx(model, None, data[0], backend=backend)
    if backend == "fbgemm":  # the advice works: the float32 copy quantizes and tracks the original
        quantized = qp.quantize(model.float(), data[0][0].float(), [(x.float(),) for (x,) in data],
                                backend=backend, progress=False)
        assert sqnr(model(data[1][0].float()), quantized(data[1][0].float())) >= MIN_SQNR_DB


class MutatesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x)


class InplaceEverywhere(nn.Module):
    """The other in-place spellings: augmented assignment on an alias, inplace functional and module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        self.relu(y)  # result unused: y itself is now relu(y)
        F.hardtanh(y, -0.5, 0.5, inplace=True)
        torch.relu_(y)
        y.add_(1.0)
        return self.head(y)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [MutatesInput, InplaceEverywhere])
def test_forward_mutating_in_place_keeps_its_semantics(cls, backend):
    torch.manual_seed(0)
    report = check_quantized_matches_float(cls().eval(), backend)
    if backend != "reference":
        assert "fc" in report.kernels


def test_quantizing_does_not_mutate_the_example_or_calibration_inputs():
    data = batches()
    before = [x.clone() for (x,) in data]
    torch.manual_seed(0)
    qp.quantize(MutatesInput().eval(), data[0], data, backend="reference", progress=False)
    assert all(torch.equal(x, b) for (x,), b in zip(data, before))


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_linear_called_twice_lowers_with_good_sqnr(backend):
    torch.manual_seed(0)
    model = CalledTwice().eval()
    report = check_quantized_matches_float(model, backend)
    assert len(report.quantized) == 2  # each call is its own int8 region
    if backend != "reference":
        assert len(report.kernels) == 2
        assert all(op.startswith("quantized::linear") for op in report.kernels.values())
    assert list(dict(model.named_children())) == ["fc"]  # the user's model is untouched
