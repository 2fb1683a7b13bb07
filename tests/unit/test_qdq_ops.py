"""torch.ops.qplug q/dq operators: the numbers of qplug_core.qparams, one node under torch.export."""

from __future__ import annotations

import pytest
import torch

from qplug_core import qparams as Q
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
