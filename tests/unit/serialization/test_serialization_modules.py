"""Module reconstruction: torch.nn layers from recovered constructor arguments, qplug modules from state."""

from __future__ import annotations

import operator

import pytest
import torch
from safetensors import safe_open
from serialization_testkit import bits, round_trip
from torch import fx, nn

from qplug_core.errors import SerializationError
from qplug_core.nn import intrinsic as nni
from qplug_core.serialization import capture_artifact

#: (layer, input shape, integer inputs up to) -- every layer is rebuilt from its attributes
LAYERS = [
    (nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False, groups=2), (2, 4, 7, 7), 0),
    (nn.Conv2d(4, 4, 3, padding="same", padding_mode="reflect", dilation=2), (2, 4, 7, 7), 0),
    (nn.ConvTranspose2d(4, 2, 3, stride=2, output_padding=1), (2, 4, 5, 5), 0),
    (nn.Conv1d(3, 5, 2), (2, 3, 9), 0),
    (nn.BatchNorm2d(4, eps=1e-3, momentum=None), (2, 4, 5, 5), 0),
    (nn.LayerNorm([5, 5], elementwise_affine=False), (2, 4, 5, 5), 0),
    (nn.LayerNorm(5, bias=False), (2, 4, 5), 0),
    (nn.GroupNorm(2, 4), (2, 4, 5, 5), 0),
    (nn.Linear(5, 3, bias=False), (2, 5), 0),
    (nn.MaxPool2d(2, ceil_mode=True), (2, 4, 5, 5), 0),
    (nn.AdaptiveAvgPool2d((2, 1)), (2, 4, 5, 5), 0),
    (nn.Upsample(scale_factor=2, mode="nearest"), (2, 4, 3, 3), 0),
    (nn.GELU("tanh"), (2, 5), 0),
    (nn.LeakyReLU(0.2), (2, 5), 0),
    (nn.PReLU(4), (2, 4, 3), 0),
    (nn.Softmax(dim=1), (2, 5), 0),
    (nn.Flatten(0, -1), (2, 3, 4), 0),
    (nn.Embedding(10, 4, padding_idx=1), (2, 6), 10),
    (nn.LSTM(4, 6, num_layers=2, batch_first=True), (2, 5, 4), 0),
    (nn.GRU(4, 6, bidirectional=True, bias=False), (5, 2, 4), 0),
    (nn.RNN(4, 6, nonlinearity="relu"), (5, 2, 4), 0),
    (nn.LSTMCell(4, 6), (2, 4), 0),
]


class Wrap(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


def _inputs(shape: tuple[int, ...], tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, tokens, shape, generator=gen) if tokens else torch.randn(*shape, generator=gen)


def _randomize(module: nn.Module) -> nn.Module:
    """Non-default values everywhere, so that a tensor loaded into the wrong place shows."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(torch.rand(tensor.shape, generator=gen) + 0.5)
    return module


@pytest.mark.parametrize(("layer", "shape", "tokens"), LAYERS, ids=[repr(layer) for layer, _, _ in LAYERS])
def test_torch_layer_is_rebuilt_from_its_constructor_arguments(layer, shape, tokens, tmp_path):
    gm = fx.symbolic_trace(_randomize(Wrap(layer)).eval())
    loaded = round_trip(gm, tmp_path)
    x = _inputs(shape, tokens)

    assert repr(loaded.layer) == repr(gm.layer)
    assert type(loaded.layer) is type(gm.layer)
    assert loaded.state_dict().keys() == gm.state_dict().keys()
    for key, value in gm.state_dict().items():
        assert torch.equal(bits(loaded.state_dict()[key]), bits(value)), key
    for actual, expected in zip(_flat(loaded(x)), _flat(gm(x)), strict=True):
        assert torch.equal(bits(actual), bits(expected))


def _flat(value) -> list[torch.Tensor]:
    """The tensors of a (nested) tuple output, as recurrent layers return."""
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    return [value]


class Residual(nn.Module):
    """A fused conv + add + relu (restored from state, ``add`` included) inside a Sequential."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nni.ConvAddReLU2d(nn.Conv2d(3, 3, 1), operator.add, nn.ReLU()))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(27, 2), nn.Dropout(0.5))
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("offset", torch.tensor([0.25]))

    def forward(self, x):
        return self.head(self.block[0](x, x)) * self.scale + self.offset


class Leaves(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, nni.FusedModule) or super().is_leaf_module(m, qualname)


def test_containers_fused_modules_and_root_tensors_round_trip(tmp_path):
    model = Residual().eval()
    model.head[2].train()  # per-module training flags are kept
    gm = fx.GraphModule(model, Leaves().trace(model))
    loaded = round_trip(gm, tmp_path)
    x = torch.randn(2, 3, 3, 3)

    fused = loaded.get_submodule("block.0")
    assert isinstance(fused, nni.ConvAddReLU2d) and fused.add is operator.add
    assert loaded.get_submodule("head.2").training and not loaded.get_submodule("head.1").training
    assert isinstance(loaded.scale, nn.Parameter) and torch.equal(loaded.offset, model.offset)
    loaded.eval()
    gm.eval()
    assert torch.equal(bits(loaded(x)), bits(gm(x)))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(4, 4)
        self.decode = nn.Linear(4, 4)
        self.decode.weight = self.encode.weight

    def forward(self, x):
        return self.decode(self.encode(x))


def test_a_shared_tensor_is_stored_once_and_stays_shared(tmp_path):
    gm = fx.symbolic_trace(Tied())
    loaded = round_trip(gm, tmp_path)

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["decode.bias", "encode.bias", "encode.weight"]
    assert loaded.decode.weight is loaded.encode.weight


def test_layer_whose_arguments_cannot_be_recovered_fails_at_capture():
    layer = nn.MultiheadAttention(4, 2, bias=False)  # ``bias`` is not kept as an attribute
    class Leaf(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return True

    root = Wrap(layer)
    gm = fx.GraphModule(root, Leaf().trace(root))
    with pytest.raises(SerializationError, match="not the same module"):
        capture_artifact(gm)
