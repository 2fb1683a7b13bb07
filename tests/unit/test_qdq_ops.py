"""torch.ops.qplug q/dq operators: the numbers of qplug_core.qparams, one node under torch.export."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qplug_core import qparams as Q
from qplug_core.errors import ModelStateError
from qplug_core.ir import qdq_ops
from qplug_core.kernels.reference import Dequantize, Quantize

PER_TENSOR = Q.QParams(torch.tensor(0.05), torch.tensor(3), torch.quint8, 0, 255)
PER_CHANNEL = Q.QParams(torch.tensor([0.02, 0.1, 0.5]), torch.tensor([0, -2, 5]), torch.qint8, -128,
                        127, axis=1)


@pytest.mark.parametrize("qp", [PER_TENSOR, PER_CHANNEL], ids=["per_tensor", "per_channel"])
def test_ops_equal_the_qparams_maths_bit_for_bit(qp):
    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(0)) * 10
    x[0, 0, 0, 0] = 0.025  # a tie: rounds half to even
    q = qdq_ops.quantize_op(x, qp)
    assert q.dtype == Q.STORAGE_DTYPE[qp.dtype]
    assert torch.equal(q, Q.quantize(x, qp))
    assert torch.equal(qdq_ops.dequantize_op(q, qp), Q.dequantize(q, qp))


def test_reference_modules_export_as_one_qplug_op_each():
    class QDQ(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.dq = Quantize(PER_TENSOR), Dequantize(PER_TENSOR)

        def forward(self, x):
            return self.dq(self.q(x))

    program = torch.export.export(QDQ(), (torch.randn(2, 3),), strict=True)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets == ["qplug.quantize_per_tensor.default", "qplug.dequantize_per_tensor.default"]
    x = torch.randn(2, 3)
    assert torch.equal(program.module()(x), Q.fake_quantize(x, PER_TENSOR))


def test_bad_qparams_raise_qplugs_error_through_the_op():
    bad = Q.QParams(torch.tensor([0.1, 0.2]), torch.tensor([0, 0]), torch.qint8, -128, 127, axis=1)
    with pytest.raises(Q.ConfigValidationError, match="2 scales / 2 zero points for 3 channels"):
        qdq_ops.quantize_op(torch.randn(2, 3), bad)


#: a reference dynamic model's first call, then every other qplug op once, in a fresh process
FIRST_CALLS = """
import sys, torch
import qplug_core as qp
ops, x = torch.ops.qplug, torch.randn(4, 3)
qp.quantize_dynamic(torch.nn.Sequential(torch.nn.Linear(3, 3)), backend="reference")(x)
s, z, sc, zc = torch.tensor(0.1), torch.tensor(0), torch.ones(3), torch.zeros(3, dtype=torch.int64)
ops.dequantize_per_tensor(ops.quantize_per_tensor(x, s, z, 0, 255, torch.uint8), s, z, 0, 255, torch.uint8)
ops.dequantize_per_channel(ops.quantize_per_channel(x, sc, zc, 1, -128, 127, torch.int8), sc, zc, 1,
                           -128, 127, torch.int8)
w, ws = torch.ones(3, 8, dtype=torch.int8), torch.ones(8)
ops.dynamic_quantized_linear(x, w, ws, None)
ops.dynamic_quantized_lstm(x[:, None], w[None], ws[None], w[None, :2], ws[None], torch.zeros(1, 16),
                           None, None)
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules))
"""


@pytest.mark.slow  # a fresh process: torch's import alone takes ~2 s of CPU here
def test_first_calls_of_the_ops_import_no_compiler():
    """torch.library.custom_op's kernels imported torch._dynamo at their first call: the first
    answer of a reference model in a fresh process took seconds."""
    result = subprocess.run([sys.executable, "-c", FIRST_CALLS], capture_output=True, text=True,
                            check=True)
    assert result.stdout.split() == ["[]"]


def test_backward_through_an_op_says_there_is_no_gradient():
    x = torch.randn(2, 3, requires_grad=True)
    y = torch.ops.qplug.dynamic_fake_quantize(x, 0, 255, torch.uint8)
    assert torch.equal(y, torch.ops.qplug.dynamic_fake_quantize(x.detach(), 0, 255, torch.uint8))
    with pytest.raises(ModelStateError, match="qplug::dynamic_fake_quantize has no gradient"):
        y.sum().backward()
