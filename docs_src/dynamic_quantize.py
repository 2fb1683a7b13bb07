"""qp.quantize_dynamic: swap Linear/LSTM/GRU for dynamic int8 kernels, no tracing, no calibration."""

import torch
from torch import nn

import qplug_core as qp


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, 5)

    def forward(self, tokens):
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


torch.manual_seed(0)
model = Tagger().eval()
tokens = torch.randint(0, 100, (4, 12))

int8 = qp.quantize_dynamic(model, backend="fbgemm")  # every Linear/LSTM/GRU/RNN cell
print(type(int8.lstm).__name__, type(int8.head).__name__)
print(f"{qp.sqnr(model(tokens), int8(tokens)):.1f} dB")

# Choose what to convert: a set of types and/or module names, or a dict with qconfigs (None = float).
only_head = qp.quantize_dynamic(model, {"head"}, backend="fbgemm")
assert type(only_head.lstm) is nn.LSTM
half = qp.quantize_dynamic(model, {nn.LSTM}, dtype=torch.float16, backend="fbgemm")
print(type(half.lstm).__name__)
