"""Serving int8 models from a multi-threaded, multi-process server (ML-platform report s26):
what a worker pays to load a model, calls from threads while another thread exports, requests
made under ``torch.autocast``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import qplug_core as qp

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)).eval()


class _Attention(nn.Module):
    """Attention scores between int8 linears: under bf16 autocast the matmul's output is bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2))
        return self.o(torch.softmax(scores, -1))


def _int8_model(mode: str) -> nn.Module:
    torch.manual_seed(0)
    model = _Attention().eval()
    if mode == "dynamic":
        return qp.quantize_dynamic(model, backend="fbgemm")
    return qp.quantize(model, (torch.randn(2, 8, 16),), [(torch.randn(4, 8, 16),)], backend=mode)


LOAD_AND_CALL = """
import sys, torch, qplug_core as qp
from torch import nn
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)).eval()
qp.load(sys.argv[1])(torch.randn(2, 8, 16))
qp.load(sys.argv[2], model=mlp)(torch.randn(2, 32))
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""


@pytest.mark.slow  # a fresh interpreter importing torch: ~3 s
def test_loading_and_calling_a_model_does_not_import_dynamo(tmp_path):
    """``qp.load`` of any file imported torch._dynamo (+71-108 MiB RSS and seconds in every worker
    of a server's pool) through ``@torch.compiler.disable`` evaluated at class definition."""
    static_file = qp.save(_int8_model("fbgemm"), tmp_path / "static.safetensors")
    dynamic_file = qp.save(qp.quantize_dynamic(_mlp(), backend="fbgemm"), tmp_path / "dynamic.safetensors")
    env = {**os.environ, "QPLUG_LOAD_PLUGINS": "fbgemm"}
    result = subprocess.run([sys.executable, "-c", LOAD_AND_CALL, str(static_file), str(dynamic_file)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("dynamo imported: False")


class _ExportsSlowly(nn.Module):
    """A model whose export waits in its forward until told to go on: another thread's calls
    happen while torch.export is running, every time."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.go_on = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.started.set()
        assert self.go_on.wait(60)
        return x + 1


SERVED = {
    "dynamic": lambda: qp.quantize_dynamic(_mlp(), backend="fbgemm"),
    "w8a8": lambda: qp.quantize_w8a8(_mlp(), [torch.randn(4, 32)]),
}


@pytest.mark.parametrize("mode", list(SERVED))
def test_calls_while_another_thread_exports_are_served(mode):
    """``torch.compiler.is_exporting()`` is true in every thread while one exports (a hot-reloaded
    onnxruntime model warming up, a user's own export): the other threads' calls of dynamic, W8A8,
    weight-only and compiled models raised "torch.export cannot capture ...". (Exporting them is still
    refused: tests/regressions/test_serving_reports.py.)"""
    model = SERVED[mode]()
    inputs = [torch.randn(3, 32) for _ in range(20)]
    expected = [model(x) for x in inputs]
    exported = _ExportsSlowly()
    exporting = threading.Thread(target=torch.export.export, args=(exported, (torch.randn(2),)))
    exporting.start()
    try:
        assert exported.started.wait(60)
        served = [model(x) for x in inputs]
    finally:
        exported.go_on.set()
        exporting.join()
    assert all(torch.equal(a, b) for a, b in zip(served, expected))


@pytest.mark.parametrize("mode", ["fbgemm", "qnnpack", "reference", "dynamic"])
def test_a_call_under_autocast_answers_as_a_plain_call(mode):
    """A server wrapping requests in ``torch.autocast("cpu", dtype=torch.bfloat16)``: a static model
    on fbgemm raised torch's "Quantize only works on Float Tensor, got BFloat16", a dynamic one an
    InputMismatchError saying to pass .float() (the caller had). The int8 model computes in float32."""
    model = _int8_model(mode)
    x = torch.randn(3, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        served = model(x)
        assert torch.is_autocast_enabled("cpu")  # the caller's autocast is back after the call
    assert torch.equal(served, model(x))
