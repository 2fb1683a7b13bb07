"""The export form of a dynamic int8 LSTM (ONNX Runtime's DynamicQuantizeLSTM): exact int8 weights
recovered from the reference grid, nn.LSTM's behaviour, clear refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qplug_core.errors import ExportError
from qplug_core.onnx_export.lstm import DynamicQuantizedLSTM, int8_grid, lstm_problem


def _integers(weight: torch.Tensor, *, per_channel: bool, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What a symmetric observer gives: integers and the step (amax / top) they are scaled by."""
    amax = weight.abs().amax(1, keepdim=True) if per_channel else weight.abs().max()
    step = amax / top
    return torch.clamp(torch.round(weight / step), -128, 127), step


def _on_grid(weight: torch.Tensor, *, per_channel: bool, top: float) -> torch.Tensor:
    q, step = _integers(weight, per_channel=per_channel, top=top)
    return q * step


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("top", [127, 127.5, 64, 63.5], ids=["8-bit", "8-bit-asym-range", "7-bit", "7-bit-asym-range"])
def test_int8_grid_recovers_the_integers_exactly(per_channel, top):
    integers, step = _integers(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)),
                               per_channel=per_channel, top=top)
    weight = integers * step
    q, scale = int8_grid(weight)
    assert q.dtype == torch.int8
    assert torch.equal(q.float(), integers)  # the observer's integers, not new ones
    torch.testing.assert_close(q.float() * scale[:, None], weight, rtol=1e-6, atol=0)


def test_float_weights_are_not_a_grid_and_the_lstm_is_refused():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 8)
    assert int8_grid(lstm.weight_ih_l0) is None
    assert "weight_ih_l0 does not lie on a symmetric int8 grid" in lstm_problem(lstm)
    with pytest.raises(ExportError, match="cannot be exported as DynamicQuantizeLSTM: weight_ih_l0"):
        DynamicQuantizedLSTM(lstm)


def _grid_lstm(**options) -> nn.LSTM:
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 8, **options).eval()
    with torch.no_grad():
        for name, weight in lstm.named_parameters():
            if name.startswith("weight"):
                weight.copy_(_on_grid(weight, per_channel=True, top=127))
    return lstm


def test_proj_size_is_refused_with_the_reason():
    assert lstm_problem(_grid_lstm(proj_size=3)) == "proj_size is set: DynamicQuantizeLSTM has no projection"


@pytest.mark.parametrize("options", [dict(num_layers=2), dict(bidirectional=True, batch_first=True)])
def test_unbatched_input_gives_what_a_batch_of_one_gives(options):
    module = DynamicQuantizedLSTM(_grid_lstm(**options))
    x = torch.randn(5, 4)
    out, (h, c) = module(x)
    batched = x.unsqueeze(0) if options.get("batch_first") else x.unsqueeze(1)
    b_out, (b_h, b_c) = module(batched)
    assert torch.equal(out, b_out.squeeze(0 if options.get("batch_first") else 1))
    assert torch.equal(h, b_h.squeeze(1)) and torch.equal(c, b_c.squeeze(1))


def test_with_float_activations_it_is_close_to_the_float_lstm():
    """Only the activations' dynamic quantization separates it from the grid-weight nn.LSTM."""
    lstm = _grid_lstm(num_layers=2, bidirectional=True)
    x, h0, c0 = torch.randn(6, 3, 4), torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    with torch.no_grad():
        (out, (h, c)), (f_out, (f_h, f_c)) = DynamicQuantizedLSTM(lstm)(x, (h0, c0)), lstm(x, (h0, c0))
    for got, expected in ((out, f_out), (h, f_h), (c, f_c)):
        assert got.shape == expected.shape
        # one uint8 step of each GEMM input is 1/255 of its range; the errors stay a few steps
        assert float((got - expected).abs().max()) <= 8 / 255 * float(expected.abs().max())
