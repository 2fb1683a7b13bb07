"""``qp.save`` / ``qp.load`` of ``qp.quantize_dynamic`` models whose LSTMs / GRUs are int8: the
same integers and outputs after load, a file of int8 weights, and the layer's options checked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import SerializationError

pytestmark = pytest.mark.usefixtures("plugin_autoload")


class Tagger(nn.Module):
    """A recurrent layer and a linear head, as a speech or tagging model has."""

    def __init__(self, rnn: type[nn.Module], seed: int = 0, **options) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.rnn = rnn(16, 32, **options)
        self.head = nn.Linear(64 if options.get("bidirectional") else 32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


CASES = [
    (nn.LSTM, dict(num_layers=2, batch_first=True), "fbgemm", False, False),
    (nn.GRU, dict(bidirectional=True, bias=False), "fbgemm", True, True),
    (nn.LSTM, dict(bidirectional=True), "qnnpack", None, None),  # the backend's defaults
]


@pytest.mark.parametrize("rnn, options, backend, per_channel, reduce_range", CASES)
def test_a_dynamic_rnn_model_loads_with_the_same_integers_and_outputs(tmp_path, rnn, options, backend, per_channel,
                                                                      reduce_range):
    from qplug_core.config.defaults import dynamic_qconfig

    qconfig = None if per_channel is None else dynamic_qconfig(per_channel=per_channel, reduce_range=reduce_range)
    qmodel = qp.quantize_dynamic(Tagger(rnn, **options).eval(), qconfig and {rnn: qconfig, nn.Linear: qconfig},
                                 backend=backend)
    path = qp.save(qmodel, tmp_path / "tagger.safetensors")
    loaded = qp.load(path, model=Tagger(rnn, seed=3, **options).eval())
    assert type(loaded.rnn) is type(qmodel.rnn) and loaded.rnn.engine == qmodel.rnn.engine
    assert loaded.rnn.reduce_range == qmodel.rnn.reduce_range
    saved, restored = qmodel.rnn.integer_weights(), loaded.rnn.integer_weights()
    assert list(saved) == list(restored)
    for (weight, bias), (weight_again, bias_again) in zip(saved.values(), restored.values()):
        assert weight.per_channel == weight_again.per_channel and per_channel in (None, weight.per_channel)
        assert all(torch.equal(a, b) for a, b in zip(weight[:3], weight_again[:3]))
        assert torch.equal(bias, bias_again)
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), qmodel(x))
    assert qp.save(loaded, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()


def test_the_file_holds_int8_weights():
    """About a quarter of the float weights' bytes (the biases and the float head stay float)."""
    import os
    import tempfile

    model = Tagger(nn.LSTM, num_layers=2).eval()
    model.rnn = nn.LSTM(16, 128, num_layers=2)
    model.head = nn.Identity()
    float_bytes = sum(p.numel() * 4 for p in model.parameters())
    with tempfile.TemporaryDirectory() as folder:
        path = qp.save(qp.quantize_dynamic(model, backend="fbgemm"), os.path.join(folder, "lstm.safetensors"))
        assert os.path.getsize(path) < 0.3 * float_bytes


def test_a_model_with_other_rnn_options_is_refused_and_left_as_it_was(tmp_path):
    qmodel = qp.quantize_dynamic(Tagger(nn.LSTM, batch_first=True).eval(), backend="fbgemm")
    path = qp.save(qmodel, tmp_path / "tagger.safetensors")
    other = Tagger(nn.LSTM).eval()
    with pytest.raises(SerializationError, match=r"layer 'rnn' has options .*'batch_first': True.* in the file "
                                                 r"but .*'batch_first': False.* in the model given"):
        qp.load(path, model=other)
    assert type(other.rnn) is nn.LSTM


def test_a_float16_dynamic_lstm_is_refused_with_the_way_out(tmp_path):
    qmodel = qp.quantize_dynamic(Tagger(nn.LSTM).eval(), {nn.LSTM}, dtype=torch.float16, backend="fbgemm")
    with pytest.raises(SerializationError, match="is a dynamic DynamicLSTM with torch.float16 weights.*"
                                                 "run qp.quantize_dynamic again"):
        qp.save(qmodel, tmp_path / "lstm.safetensors")
