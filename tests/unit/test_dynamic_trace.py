"""``torch.jit.trace`` of a ``qp.quantize_dynamic`` LSTM/GRU raised inside torch ("Tried to trace
<CellParamsBase> but it is not part of the active trace": the packed cells sat in a plain list);
docs/guide/dynamic.md says tracing works, and torch.ao's dynamic LSTM traces (mobile report, 2)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import engine_context


class TextRNN(nn.Module):
    def __init__(self, rnn: type[nn.Module]):
        super().__init__()
        self.rnn = rnn(16, 24, num_layers=2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(48, 4)

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


@pytest.mark.slow  # the process's first torch.jit.trace takes ~4 s; each case itself ~0.5 s
@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU])
def test_a_traced_dynamic_rnn_answers_as_the_model_after_jit_save_and_load(plugin_autoload, tmp_path, rnn):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qnnpack on x86, TracerWarnings of the input checks
        int8 = qp.quantize_dynamic(TextRNN(rnn).eval(), backend="qnnpack")
        traced = torch.jit.trace(int8, (torch.randn(2, 5, 16),))
    torch.jit.save(traced, tmp_path / "m.pt")
    x = torch.randn(3, 7, 16)
    with engine_context("qnnpack"):  # a TorchScript file packs its weights again for the engine it loads under
        loaded = torch.jit.load(tmp_path / "m.pt")
        assert torch.equal(loaded(x), int8(x))


def test_a_traced_dynamic_lstm_cell_answers_as_the_model(plugin_autoload):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qnnpack on x86, TracerWarnings of the input checks
        int8 = qp.quantize_dynamic(nn.Sequential(nn.LSTMCell(8, 16)).eval(), backend="qnnpack")
        traced = torch.jit.trace(int8, (torch.randn(2, 8),))
    x = torch.randn(5, 8)
    assert all(torch.equal(a, b) for a, b in zip(traced(x), int8(x)))


def test_a_dynamic_lstm_still_copies_and_saves(plugin_autoload, tmp_path):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qnnpack on x86
        int8 = qp.quantize_dynamic(TextRNN(nn.LSTM).eval(), backend="qnnpack")
        loaded = qp.load(qp.save(int8, tmp_path / "m.safetensors"), model=TextRNN(nn.LSTM).eval())
    x = torch.randn(3, 7, 16)
    assert torch.equal(copy.deepcopy(int8)(x), int8(x))
    assert torch.equal(loaded(x), int8(x))
