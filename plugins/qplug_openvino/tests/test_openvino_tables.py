"""Invalid embedding ids in OpenVINO partitions: refused as the float table refuses them (OpenVINO's
Gather gives zeros past the table, and counts -1 from its end)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import QplugError


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.table, self.fc = nn.Embedding(100, 16), nn.Linear(16, 4)

    def forward(self, ids):
        return self.fc(self.table(ids))


@pytest.fixture(scope="module")
def quantized():
    torch.manual_seed(0)
    model = Lookup().eval()
    example = (torch.randint(0, 100, (8,)),)
    return model, qp.quantize(model, example, [example], backend="openvino")


@pytest.mark.parametrize("bad", [-1, 100])
def test_ids_the_float_table_refuses_are_refused(quantized, bad):
    model, qmodel = quantized
    ids = torch.tensor([3, bad, 5])
    with pytest.raises(IndexError):
        model(ids)
    with pytest.raises(QplugError, match=f"input 'ids' holds ids from {min(3, bad)} to {max(5, bad)}, "
                                                  "but the table 'table' it indexes has 100 rows") as refused:
        qmodel(ids)
    assert type(refused.value).__name__ == "InputMismatchError"
    good = torch.tensor([3, 99, 0])
    with torch.no_grad():
        torch.testing.assert_close(qmodel(good), model(good), rtol=0, atol=0.05)
