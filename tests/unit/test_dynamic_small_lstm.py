"""fbgemm's dynamic LSTM is slower than float below 192 hidden units (bench/bench_dynamic_rnn.py
--clock thread: 0.25-0.96x at hidden 32-128): ``qp.quantize_dynamic`` says so and names the
faster route, as it does for qnnpack on x86 (time-series report, F3). Its GRU is not slower."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

import qplug_core as qp


class Forecaster(nn.Module):
    def __init__(self, rnn: type[nn.Module], hidden: int):
        super().__init__()
        self.rnn = rnn(8, hidden, 2, batch_first=True)
        self.head = nn.Linear(hidden, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def test_a_small_lstm_on_fbgemm_warns_and_names_the_onnxruntime_route(plugin_autoload):
    with pytest.warns(UserWarning, match=r"fbgemm's dynamic int8 LSTM is slower than the float one below 192 "
                                         r"hidden units .*'rnn' \(hidden 64\)\. backend='onnxruntime' with "
                                         r"example_inputs="):
        qp.quantize_dynamic(Forecaster(nn.LSTM, 64).eval(), backend="fbgemm")


@pytest.mark.parametrize(("rnn", "hidden"), [(nn.LSTM, 256), (nn.GRU, 64)])
def test_a_large_lstm_or_a_gru_does_not_warn(plugin_autoload, rnn, hidden):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp.quantize_dynamic(Forecaster(rnn, hidden).eval(), backend="fbgemm")
