"""When neither torch.export nor symbolic tracing captures a model, the error leads with
torch.export's (the one to act on), says so in plain words for packed sequences (the tracer's own
error is about a CUDA attribute), and names ``qp.quantize_dynamic``'s module swap when the model
has layers it swaps; a ``forward(*args)`` takes any number of example inputs (time-series report, F5/F8)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import qplug_core as qp
from qplug_core.errors import NothingQuantizedError, TraceError

_MODULE_SWAP = ("qp.quantize_dynamic(model, backend='fbgemm') needs no graph: it swaps Linear/LSTM/GRU "
                "layers (here {}) for int8 ones")


class Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 2)

    def forward(self, x, lengths):
        out, _ = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        return self.head(pad_packed_sequence(out, batch_first=True)[0][:, -1])


class ValueBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = ValueBranch()

    def forward(self, x):
        return torch.relu(self.inner(x))


@pytest.mark.slow  # torch.export's attempt at a packed LSTM: ~10 s on the shared machine
def test_packed_sequences_are_named_and_the_tracers_cuda_text_is_gone(plugin_autoload):
    example = (torch.randn(3, 5, 8), torch.tensor([5, 3, 2]))
    with pytest.raises(TraceError) as caught:
        qp.quantize(Packed().eval(), example, [example], backend="fbgemm", recipe="none", progress=False)
    message = str(caught.value)
    assert message.startswith("neither torch.export nor symbolic tracing can capture Packed: it packs "
                              "sequences (torch.nn.utils.rnn.pack_padded_sequence / PackedSequence)"), message
    assert "cuda" not in message.lower() and "pad and mask instead" in message
    assert message.endswith(_MODULE_SWAP.format("1 LSTM, 1 Linear"))


def test_the_torch_export_error_comes_first_then_symbolic_tracings(plugin_autoload):
    x = torch.randn(2, 4)
    with pytest.raises(TraceError) as caught:
        qp.quantize(ValueBranch().eval(), (x,), [(x,)], backend="fbgemm", recipe="none", progress=False)
    message = str(caught.value)
    assert message.startswith("neither torch.export nor symbolic tracing can capture ValueBranch: "
                              "torch.export could not capture ValueBranch: "), message
    assert message.index("; symbolic tracing: cannot trace the top-level forward") > 0
    assert message.endswith(_MODULE_SWAP.format("1 Linear"))


def test_a_submodule_neither_captures_leads_the_nothing_quantized_reasons_with_torch_export(plugin_autoload):
    x = torch.randn(2, 4)
    with (pytest.raises(NothingQuantizedError) as caught,
          pytest.warns(UserWarning, match="keeps ValueBranch 'inner' float")):
        qp.quantize(Wrapper().eval(), (x,), [(x,)], backend="fbgemm", recipe="none", progress=False)
    assert "Top reasons ops stayed float: capture failed: torch.export could not capture" in str(caught.value)
    assert _MODULE_SWAP.format("1 Linear") in str(caught.value)


class Varargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, *inputs):
        return self.fc(inputs[0] + inputs[1] * inputs[4])


def test_a_varargs_forward_takes_any_number_of_example_inputs(plugin_autoload):
    torch.manual_seed(0)
    model, xs = Varargs().eval(), tuple(torch.randn(2, 4) for _ in range(5))
    quantized = qp.quantize(model, xs, [xs], backend="fbgemm", recipe="none", progress=False)
    with torch.no_grad():
        expected, got = model(*xs), quantized(*xs)
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
