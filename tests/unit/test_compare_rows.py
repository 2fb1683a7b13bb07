"""qp.compare pairs a layer whose int8 form outputs the float module's rows with the leading dims
flattened (GPT-2's Conv1D under torch.export: every c_attn / c_proj / c_fc was skipped with
"output shapes differ: (2, 16, 192) vs (32, 192)")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class Conv1D(nn.Module):
    """GPT-2's linear: ``addmm`` on the rows of ``x``, viewed back to ``x``'s leading dims."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(x.size()[:-1] + (self.nf,))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = Conv1D(32, 16), Conv1D(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x)))


def test_rows_flattened_by_the_int8_layer_are_compared_with_the_float_modules_rows():
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 5, 16)
    qmodel = qp.quantize(model, (x,), [(torch.randn(2, 5, 16),) for _ in range(4)], backend="fbgemm",
                         capture="export", progress=False)
    outputs = {}
    model.fc.register_forward_hook(lambda m, i, o: outputs.setdefault("float", o))
    qmodel.get_submodule("fc").register_forward_hook(lambda m, i, o: outputs.setdefault("int8", o))
    report = qp.compare(model, qmodel, (x,))
    rows = {layer.name: layer for layer in report.layers}
    assert set(rows) == {"fc", "proj"} and not report.skipped
    int8 = outputs["int8"].dequantize() if outputs["int8"].is_quantized else outputs["int8"]
    assert int8.shape == (10, 32) and outputs["float"].shape == (2, 5, 32)  # the case this is about
    by_hand = qp.sqnr(outputs["float"], int8.reshape(2, 5, 32))
    assert rows["fc"].sqnr_db == pytest.approx(float(by_hand), abs=1e-3)
