"""QuantizationReport's text: the int8 share first, compute ops by reason, plumbing folded; and
op_kind, which tells the two apart (SkippedNode.kind keeps it in the data)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import SerializationError
from qplug_core.flows.op_kinds import COMPUTE, INTEGER, SHAPE, op_kind


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        y = self.fc1(x).reshape(x.shape[0], 4, 4).transpose(1, 2).reshape(x.shape[0], 16)
        return torch.sigmoid(self.fc2(torch.erf(y)))


@pytest.fixture(scope="module")
def quantized():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    return qp.quantize(Net().eval(), (x,), [x], backend="reference", progress=False)


def test_text_leads_with_the_int8_share_and_folds_plumbing(quantized):
    report = qp.quantization_report(quantized)
    lines = str(report).splitlines()
    assert lines[0].startswith("qplug quantization report: backend reference")
    assert lines[1].startswith("int8: 100% of weights (")  # erf and sigmoid hold none
    assert all(len(line) <= 80 for line in lines)
    compute = [s for s in report.skipped if s.kind == COMPUTE]
    plumbing = [s for s in report.skipped if s.kind != COMPUTE]
    assert {s.op for s in compute} >= {"erf"} and plumbing
    assert {s.op for s in plumbing} <= {"reshape", "transpose", "size", "getattr", "getitem"}
    folded = [line for line in lines if "shape and integer op(s)" in line]
    assert len(folded) == 1 and f"+ {len(plumbing)} " in folded[0]
    verbose = "\n".join(__import__("qplug_core.flows.report", fromlist=["x"]).report_lines(
        report, verbose=True))
    assert all(f"{s.node} ({s.op})" in " ".join(verbose.split()) for s in report.skipped)


@pytest.mark.parametrize("value_kind,op,kind", [
    ("float_tensor", "erf", COMPUTE), ("float_tensor", "LayerNorm", COMPUTE),
    ("float_tensor", "view.default", SHAPE), ("float_tensor", "slice.Tensor", SHAPE),
    ("other", "sym_size.int", SHAPE), ("tensor", "add", INTEGER), ("tensor", "gather", INTEGER),
    (None, "expand", SHAPE), (None, "matmul", COMPUTE),
])
def test_op_kind(value_kind, op, kind):
    assert op_kind(value_kind, op) == kind


def test_torch_save_of_an_int8_model_points_to_qp_save(quantized):
    with pytest.raises(SerializationError, match=r"qp\.save\(model"):
        torch.save(quantized, io.BytesIO())
    torch.save(Net(), io.BytesIO())  # other models are untouched
