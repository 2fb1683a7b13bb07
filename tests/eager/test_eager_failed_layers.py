"""An eager-converted model's failing int8 layer names itself, as graph mode's and the swapped-in
layers' failures do (``qplug_core/eager/failed_layers.py``): fbgemm's kernels said "int8 Conv2d takes
inputs with 3 channels" and torch "Quantize only works on Float Tensor, got Double", naming no layer,
and the reference form took float64, float16 and int64 inputs the float model refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.eager import DeQuantStub, QuantStub
from qplug_core.errors import InputMismatchError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc(torch.flatten(self.conv(self.quant(x)), 1)))


@pytest.fixture(scope="module")
def float_net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


@pytest.fixture(scope="module")
def converted(float_net) -> dict[str, nn.Module]:
    return {backend: _converted(float_net, backend) for backend in ("fbgemm", "reference")}


def _converted(model: Net, backend: str) -> nn.Module:
    observed = qp.eager.prepare(copy.deepcopy(model), backend=backend)
    with torch.no_grad():
        for seed in range(2):
            observed(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed)))
    return qp.eager.convert(observed)


def _raised(call) -> Exception:
    with pytest.raises(Exception) as info:
        call()
    return info.value


@pytest.mark.parametrize("backend", ["fbgemm", "reference"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64])
def test_an_input_of_another_dtype_names_the_quant_stub_as_the_float_model_refuses_it(float_net, converted,
                                                                                      backend, dtype):
    int8 = converted[backend]
    x = torch.randn(2, 3, 8, 8).to(dtype)
    builtin = type(_raised(lambda: float_net(x)))
    error = _raised(lambda: int8(x))
    assert isinstance(error, InputMismatchError) and isinstance(error, builtin), type(error).__mro__
    assert str(error).startswith("layer 'quant' (")
    assert f"takes float32 inputs, got {str(dtype).removeprefix('torch.')} of shape (2, 3, 8, 8)" in str(error)


def test_a_wrong_shape_names_the_int8_layer_and_copies_keep_naming_it(converted):
    int8 = converted["fbgemm"]
    with pytest.raises(InputMismatchError, match=r"^layer 'conv' \(.*\): int8 Conv2d takes inputs with 3 channels"):
        int8(torch.randn(2, 5, 8, 8))
    copied = copy.deepcopy(int8)
    with pytest.raises(InputMismatchError, match=r"^layer 'fc' \(.*\): int8 Linear takes inputs with 144 features"):
        copied(torch.randn(2, 3, 9, 9))
    assert torch.equal(copied(torch.ones(1, 3, 8, 8)), int8(torch.ones(1, 3, 8, 8)))  # (assert_close imports 4 s)


class ScaledNet(Net):
    """Net whose forward reads a plain attribute of the root: a copy that sets it must see it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


@pytest.mark.parametrize("make_copy", [copy.copy, copy.deepcopy])
def test_a_copy_of_a_converted_model_calls_itself(make_copy):
    # before: the call on the instance was bound to the model it was made for, and a shallow copy
    # shares instance entries: copy.copy(int8) ran the original, ignoring what was set on the copy
    torch.manual_seed(0)
    int8 = _converted(ScaledNet().eval(), "fbgemm")
    x = torch.randn(1, 3, 8, 8)
    expected = int8(x)
    copied = make_copy(int8)
    copied.scale = 2.0
    assert torch.equal(copied(x), 2 * expected)
    assert torch.equal(int8(x), expected)
    with pytest.raises(InputMismatchError, match=r"^layer 'conv' \(.*\): int8 Conv2d takes inputs with 3 channels"):
        copied(torch.randn(2, 5, 8, 8))  # the copy still names its failing layer
