"""An eager-converted model's layers run as torch.ao's eager int8 modules do: without a hook or a
wrapper of qplug's on each (``bench/bench_eager_call_overhead.py`` times what those cost). The
model's own call, wrapped once, runs under its engine and names a failed layer; pooling modules
keep their restride pre-hook only where a batch-1 view reaches them (``test_eager_batch_stride.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import InputMismatchError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.relu1, self.pool = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        self.conv2, self.gap, self.fc = nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.gap(self.conv2(self.pool(self.relu1(self.conv1(x))))), 1))


def _per_call_layers(module: nn.Module) -> list[str]:
    return [*(f"pre-hook {h}" for h in module._forward_pre_hooks.values()),
            *(f"hook {h}" for h in module._forward_hooks.values()),
            *(["forward on the instance"] if "forward" in vars(module) else [])]


def test_a_converted_cnn_carries_one_wrapper_on_its_call_and_none_on_its_layers():
    torch.manual_seed(0)
    observed = qp.eager.prepare(qp.eager.QuantWrapper(SmallCNN().eval()), backend="fbgemm")
    with torch.no_grad():
        for seed in range(2):  # batch 4: the first call is kept whole, the restride probe takes a row
            observed(torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed)))
    int8 = qp.eager.convert(observed)
    layers = {name: _per_call_layers(m) for name, m in int8.named_modules()}
    assert layers.pop("") == ["forward on the instance"]
    assert {name: found for name, found in layers.items() if found} == {}

    seen = []
    int8.module.pool.register_forward_pre_hook(lambda m, args: seen.append(torch.backends.quantized.engine))
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "qnnpack"
    with torch.no_grad():
        try:
            int8(torch.randn(1, 3, 8, 8))
            assert seen == ["fbgemm"]  # pooling dispatches on the global engine: the model's, in its call
            with pytest.raises(InputMismatchError, match=r"^layer 'module\.conv1' \(.*\): int8 Conv2d takes inputs"):
                int8(torch.randn(1, 5, 8, 8))
            assert torch.backends.quantized.engine == "qnnpack"  # the caller's, also after a failed call
        finally:
            torch.backends.quantized.engine = previous


class PoolsBatches(nn.Module):
    """Pools only batches of more than one: the one-row run convert makes does not reach the pool."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = qp.eager.QuantStub(), qp.eager.DeQuantStub()
        self.conv, self.pool = nn.Conv2d(3, 4, 1), nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.quant(x))
        return self.dequant(self.pool(y) if y.shape[0] > 1 else y)


def test_a_pooling_module_the_one_row_run_does_not_reach_keeps_its_restride():
    observed = qp.eager.prepare(PoolsBatches().eval(), backend="fbgemm")
    with torch.no_grad():
        observed(torch.randn(4, 3, 4, 4))
    assert len(qp.eager.convert(observed).pool._forward_pre_hooks) == 1
