"""ONNX Runtime's MatMulNBits as a weight-only kernel: against the float64 definition, and found
through the ``qplug_weight_only_kernels`` hook of the installed plugin."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import WeightOnlyScheme
from qplug_core.plugin_api import quantize_weight as quantize
from qplug_core.plugin_api import weight_only_definition as definition

from qplug_onnxruntime.weight_only import MatMulNBitsKernel

#: MatMulNBits with accuracy_level=4 rounds activations to int8 per block: relative L2 error ~0.5%
TOLERANCE = 0.015


@pytest.mark.parametrize(("bits", "group_size", "symmetric", "n", "k"), [
    (4, 32, True, 37, 96),     # odd N, three groups
    (4, 32, False, 37, 96),    # an odd number of zero points per row: the last byte holds one
    (4, 128, False, 64, 256),
    (4, 16, True, 8, 48),
    (8, 32, True, 37, 96),
    (8, 64, False, 40, 128),
    (8, None, True, 37, 384),   # per channel: the row's scale in each block of 128
    (8, None, False, 40, 128),  # per channel, K a block size itself: one block per row
    (4, None, False, 24, 320),  # per channel int4, blocks of 64, zero points repeated and packed
])
def test_matmulnbits_computes_the_definition(bits, group_size, symmetric, n, k):
    g = torch.Generator().manual_seed(n + k + bits)
    weight = quantize(torch.randn(n, k, generator=g), WeightOnlyScheme(bits, group_size, symmetric))
    kernel = MatMulNBitsKernel()
    assert kernel.supports(weight.scheme, weight.shape, torch.float32) is None
    packed = kernel.pack(weight)
    x, bias = torch.randn(5, k, generator=g), torch.randn(n, generator=g)
    expected = x.double() @ definition(weight).T + bias.double()
    got = kernel.run(packed, x, bias)
    assert got.shape == (5, n)
    assert float((got.double() - expected).norm() / expected.norm()) < TOLERANCE
    torch.set_num_threads(2)  # a session per thread count, same result
    again = kernel.run(packed, x, bias)
    assert float((again.double() - expected).norm() / expected.norm()) < TOLERANCE


def test_matmulnbits_refuses_what_it_cannot_run():
    kernel = MatMulNBitsKernel()
    assert "block (group) size" in kernel.supports(WeightOnlyScheme(8, 48), (16, 96), torch.float32)
    assert "multiple of 16, not 50" in kernel.supports(WeightOnlyScheme(8), (16, 50), torch.float32)
    assert "float32 activations only" in kernel.supports(WeightOnlyScheme(4, 32), (16, 96), torch.bfloat16)


def test_hook_qplug_weight_only_kernels():
    model = nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 32))
    measured = qp.quantize_weights(model, bits=4, group_size=16, backend="onnxruntime")
    assert "onnxruntime-matmulnbits" in measured.qplug_weight_only.choices[0].timings_ms
    with pytest.raises(qp.errors.ConfigValidationError, match="no weight-only kernel is called"):
        qp.quantize_weights(model, bits=4, group_size=16, backend="reference", kernel="onnxruntime-matmulnbits")
    qmodel = qp.quantize_weights(model, bits=4, group_size=16, kernel="onnxruntime-matmulnbits")
    assert set(qmodel.qplug_weight_only.kernels.values()) == {"onnxruntime-matmulnbits"}
    x = torch.randn(2, 3, 64)
    reference = qp.quantize_weights(model, bits=4, group_size=16, kernel="reference")
    with torch.no_grad():
        got, expected = qmodel(x), reference(x)
    assert got.shape == (2, 3, 32)
    assert float((got - expected).norm() / expected.norm()) < TOLERANCE


def test_one_thread_keeps_its_session_and_other_counts_replace_theirs():
    """Each session holds its own packed copy of the weight: at most two, one for one thread (a
    decoder's decode steps) and one for the latest count above, and not the serialized model besides."""
    g = torch.Generator().manual_seed(3)
    weight = quantize(torch.randn(48, 64, generator=g), WeightOnlyScheme(4, 32, True))
    packed = MatMulNBitsKernel().pack(weight)
    x = torch.randn(2, 64, generator=g)
    before = torch.get_num_threads()
    try:
        results, built = [], []
        for threads, held in ((1, [1]), (2, [1, 2]), (1, [1, 2]), (2, [1, 2]), (3, [1, 3])):
            torch.set_num_threads(threads)
            results.append(MatMulNBitsKernel().run(packed, x, None))
            built.append(packed._sessions[threads])
            assert sorted(packed._sessions) == held
            for count, session in packed._sessions.items():
                assert session.get_session_options().intra_op_num_threads == count
                assert getattr(session, "_model_bytes", None) is None  # no serialized weight kept
    finally:
        torch.set_num_threads(before)
    assert built[0] is built[2] and built[1] is built[3]  # switching back builds nothing
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[3])


class Projections(nn.Module):
    """Three linears reading one input, like attention's q/k/v."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = nn.Linear(128, 96), nn.Linear(128, 32, bias=False), nn.Linear(128, 64)

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("threads", [1, 2])
def test_linears_reading_one_input_run_as_one_matmulnbits_with_the_same_outputs(bits, threads):
    """One session for the three: each output row is the same block-wise dot product."""
    options = dict(bits=bits, group_size=32, kernel="onnxruntime-matmulnbits")
    fused = qp.quantize_weights(Projections(), calibration_data=[torch.randn(3, 128)], **options)
    one_each = qp.quantize_weights(Projections(), **options)  # no example input: one call per layer
    assert fused.qplug_weight_only.fused == [("q", "k", "v")] and one_each.qplug_weight_only.fused == []
    torch.set_num_threads(threads)
    for rows in (1, 5):
        x = torch.randn(rows, 128)
        with torch.no_grad():
            assert all(torch.equal(a, b) for a, b in zip(fused(x), one_each(x), strict=True))


def test_a_copy_builds_sessions_of_its_own_and_pickling_is_refused():
    """Pickling carried the sessions' kernels chosen for the quantizing CPU and runs code when read:
    a module-swap model ships with qp.save / qp.load(path, model=...), like graph models."""
    import copy
    import pickle

    options = dict(bits=4, group_size=32, kernel="onnxruntime-matmulnbits")
    qmodel = qp.quantize_weights(Projections(), calibration_data=[torch.randn(3, 128)], **options)
    x = torch.randn(2, 128)
    with torch.no_grad():
        expected = qmodel(x)
        clone = copy.deepcopy(qmodel)
        # the members' rows stay views of one stacked weight in the copy
        assert clone.q.qweight.untyped_storage().data_ptr() == clone.v.qweight.untyped_storage().data_ptr()
        assert clone.q.fused[0] is not qmodel.q.fused[0]
        assert all(torch.equal(a, b) for a, b in zip(clone(x), expected, strict=True))
    with pytest.raises(qp.errors.SerializationError, match="qp.save"):
        pickle.dumps(qmodel)
