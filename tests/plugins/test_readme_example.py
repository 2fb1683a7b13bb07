"""The README's plugin example works as written: installed as a distribution, listed, used."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

import qplug_core as qp

README = Path(__file__).resolve().parents[2] / "README.md"


def _block(first_line: str) -> str:
    blocks = re.findall(r"```(?:python|toml)\n(.*?)```", README.read_text(), re.S)
    return next(b for b in blocks if b.startswith(first_line))


def test_readme_plugin_example_is_listed_and_quantizes(fake_dist):
    assert 'mynpu = "qplug_mynpu.plugin:plugin"' in _block("# pyproject.toml")
    fake_dist("qplug-mynpu", _block("# qplug_mynpu/plugin.py"), module="qplug_mynpu_plugin:plugin",
              entry_point="mynpu")
    assert "mynpu" in [info.name for info in qp.list_backends()]
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(16, 8)
    qmodel = qp.quantize(model, (x,), [x], backend="mynpu")
    assert set(qp.quantization_report(qmodel).kernels.values()) == {"quantized::linear"}
    assert qp.sqnr(model(x), qmodel(x)) > 25
