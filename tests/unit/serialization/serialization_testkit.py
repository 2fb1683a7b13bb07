"""Models for the serialization tests: a conv-bn-relu + residual + linear net, quantized for real."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import fx, nn

import qplug_core as qp
from qplug_core.flows.tags import ARTIFACT
from qplug_core.kernels.reference import Dequantize, Quantize, ReferenceWeighted
from qplug_core.qparams import quantize as quantize_values
from qplug_core.serialization import capture_artifact, load, save


class ResidualNet(nn.Module):
    """conv -> bn -> relu, a residual conv + add, then a linear head."""

    def __init__(self, channels: int = 8, size: int = 8, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.fc = nn.Linear(channels * size * size, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn(self.conv(x)))
        y = self.conv2(y) + y
        return self.fc(torch.flatten(y, 1))


class EmbeddingBagOfWords(nn.Module):
    """An embedding table (weight-only, float zero points) feeding a linear layer."""

    def __init__(self, vocabulary: int = 50, dim: int = 16):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, dim, padding_idx=0)
        self.fc = nn.Linear(dim, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embedding(tokens).mean(dim=1))


class MLP(nn.Module):
    """Weight-heavy: nearly all bytes are linear weights."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


def batches(shape: tuple[int, ...], count: int = 4, seed: int = 0, tokens: int = 0
            ) -> list[tuple[torch.Tensor]]:
    """Random float batches, or integer token batches in ``[0, tokens)`` when ``tokens`` is set."""
    gen = torch.Generator().manual_seed(seed)
    if tokens:
        return [(torch.randint(0, tokens, shape, generator=gen),) for _ in range(count)]
    return [(torch.randn(*shape, generator=gen),) for _ in range(count)]


def quantize(model: nn.Module, shape: tuple[int, ...], backend: str = "reference", tokens: int = 0
             ) -> fx.GraphModule:
    """Static PTQ of ``model`` for ``backend``: the reference form, or lowered to the backend."""
    torch.manual_seed(0)
    data = batches(shape, tokens=tokens)
    observed = qp.prepare_fx(model.eval(), qp.get_default_qconfig_mapping(backend), data[0], backend=backend)
    qp.calibrate(observed, data, progress=False)
    if backend == "reference":
        return qp.convert_to_reference_fx(observed)
    return qp.convert_fx(observed)


def int8_state(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every quantized weight (as int8 values) and every qparams tensor of a reference model."""
    state = {}
    for name, module in gm.named_modules():
        if isinstance(module, ReferenceWeighted):
            qparams = module.weight_qparams
            state[f"{name}.int8"] = quantize_values(module.weight.detach(), qparams)
            state[f"{name}.scale"], state[f"{name}.zero_point"] = qparams.scale, qparams.zero_point
        elif isinstance(module, (Quantize, Dequantize)):
            state[f"{name}.scale"], state[f"{name}.zero_point"] = module.scale, module.zero_point
    return state


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so that equality is bitwise (-0.0 != 0.0, NaN == NaN)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(bits(a[key]), bits(b[key])), key


def round_trip(gm: fx.GraphModule, directory: Path) -> fx.GraphModule:
    """Capture any reference-form GraphModule, save it and load it back (no lowering)."""
    gm.meta[ARTIFACT] = capture_artifact(gm)
    return load(save(gm, directory / "model.safetensors"))
