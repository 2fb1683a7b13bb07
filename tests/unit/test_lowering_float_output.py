"""A float-output kernel (weight-only embedding) feeding an int8 op keeps the quantize between them.

Regression: the quantize after an embedding belongs to the next op's input, but lowering took it
for the embedding's own output and wired a float tensor into ``quantized::linear`` (crash at the
first call). PyTorch's text-classification tutorial model (embedding -> linear) hit it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp


class EmbeddingClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.hidden = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, ids):
        return self.head(torch.relu(self.hidden(self.embed(ids))).mean(1))


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_embedding_then_linear_lowers_and_answers_like_float(plugin_autoload, backend):
    torch.manual_seed(0)
    model = EmbeddingClassifier().eval()
    gen = torch.Generator().manual_seed(1)
    calibration = [(torch.randint(0, 100, (4, 16), generator=gen),) for _ in range(4)]
    qmodel = qp.quantize(model, (torch.ones(1, 16, dtype=torch.long),), calibration,
                         backend=backend, progress=False)
    kernels = qp.quantization_report(qmodel).kernels
    assert kernels["embed"].startswith("quantized::embedding") and kernels["hidden"]
    held_out = torch.randint(0, 100, (8, 16), generator=gen)
    assert qp.sqnr(model(held_out), qmodel(held_out)) > 35
