"""What a converted model holds in RAM: int8 weights, as its file does, not the float ones again.

The README promises an int8 model "about four times smaller". These tests count the bytes of the
tensors a converted model keeps alive (its parameters and buffers, its kernels' packed weights, the
reference form it keeps for ``qp.save``) against the float model's parameters, and check that the
reference form it keeps still runs and saves bit-exactly.
"""

from __future__ import annotations

import importlib.metadata
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.flows.snapshot import snapshot_of
from qplug_core.registry import plugins

pytestmark = pytest.mark.usefixtures("installed_backends")

WIDTH = 256


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)).eval()


def _quantize(model: nn.Module, backend: str) -> torch.fx.GraphModule:
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qp.quantize(model, (torch.randn(1, WIDTH),), [torch.randn(8, WIDTH) for _ in range(4)],
                           backend=backend)


@pytest.fixture
def onnxruntime_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        importlib.metadata.version("qplug-onnxruntime")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("qplug-onnxruntime is not installed (pip install -e plugins/qplug_onnxruntime)")
    monkeypatch.setenv(plugins.ENV_LOAD, "qplug-onnxruntime")
    plugins.reset()


def test_a_delegated_model_keeps_no_float_weights_among_its_parameters(onnxruntime_backend):
    qmodel = _quantize(_mlp(), "onnxruntime")
    assert [name for name, _ in qmodel.named_parameters()] == []
    assert [key for key, value in qmodel.state_dict().items()
            if value.is_floating_point() and value.numel() > 100] == []
    x = torch.randn(5, WIDTH)
    assert torch.allclose(qmodel(x), snapshot_of(qmodel).graph_module(x), atol=0.05)
