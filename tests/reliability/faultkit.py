"""Toy models and data shared by the fault-injection tests."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


class ConvNet(nn.Module):
    """conv-bn-relu -> depthwise conv -> flatten -> linear: fusion, 7-bit depthwise input, kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.dw = nn.Conv2d(4, 4, 3, groups=4)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.dw(self.relu(self.bn(self.conv(x)))), 1))


def conv_net() -> ConvNet:
    torch.manual_seed(0)
    model = ConvNet()
    with torch.no_grad():  # non-trivial batch-norm statistics, so folding them changes weights
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model.eval()


def images(n: int = 3, seed: int = 1) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, 8, 8, generator=gen),) for _ in range(n)]


def state_digest(module: nn.Module) -> str:
    """SHA-256 over every state_dict entry: name, dtype, shape and raw bytes."""
    digest = hashlib.sha256()
    for name, value in module.state_dict().items():
        if not isinstance(value, torch.Tensor):
            digest.update(f"{name}={value!r}".encode())
            continue
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        value = value.detach().cpu().contiguous().reshape(-1)
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def quantized_digests(backend: str = "fbgemm") -> tuple[str, str]:
    """Quantize the ConvNet with fixed data; digest of the reference model and of its outputs."""
    import qplug_core as qp

    model, data = conv_net(), images(4)
    observed = qp.prepare_fx(model, None, data[0], backend=backend)
    qp.calibrate(observed, data)
    reference = qp.convert_to_reference_fx(observed)
    lowered = qp.convert_fx(observed)
    outputs = torch.cat([lowered(*batch) for batch in images(2, seed=9)])
    out = outputs.detach().contiguous().view(torch.uint8).numpy().tobytes()
    return state_digest(reference), hashlib.sha256(out).hexdigest()
