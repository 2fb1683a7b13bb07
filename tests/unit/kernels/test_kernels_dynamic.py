"""Dynamic (Linear, LSTM, GRU, cells) and weight-only embedding kernels vs float references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_reference import ENGINES
from torch import nn

from qplug_core.errors import ConfigValidationError, ConstraintViolationError
from qplug_core.kernels.capabilities import engine_capabilities
from qplug_core.kernels.cpu import override_cpu_flags
from qplug_core.kernels.reference import rounded_copy
from qplug_core.kernels.torch_int8 import (
    DynamicGRU,
    DynamicLinear,
    DynamicLSTM,
    Embedding,
    EmbeddingBag,
    GRUCell,
    LSTMCell,
    RNNCell,
    symmetric_weight_qparams,
)
from qplug_core.qparams import QParams

CI = settings(derandomize=True, max_examples=25, deadline=None)
WEIGHT_DTYPES = [torch.qint8, torch.float16]


def skip_unsupported(engine: str, dtype: torch.dtype) -> None:
    if dtype == torch.float16 and not engine_capabilities(engine).fp16_dynamic_linear:
        pytest.skip(f"{engine} cannot pack fp16 weights on this torch build (probed)")


def fake_quant(w: torch.Tensor, per_channel: bool) -> torch.Tensor:
    qp = symmetric_weight_qparams(w, per_channel)
    s = qp.scale.reshape(-1, 1) if per_channel else qp.scale
    return torch.round(w / s).clamp(-128, 127) * s


@pytest.mark.parametrize("engine", ENGINES)
@CI
@given(batch=st.integers(1, 4), k=st.integers(1, 40), n=st.integers(1, 12), per_channel=st.booleans(),
       relu=st.booleans(), seed=st.integers(0, 2**16))
def test_dynamic_linear_int8_error_bound(engine, batch, k, n, per_channel, relu, seed):
    """|y - y_ref| <= 2 s_x * sum|w_q| (loose: the ops pick their own
    run-time activation qparams, which may nudge the range), y_ref on the quantized weight."""
    torch.manual_seed(seed)
    lin, x = nn.Linear(k, n), torch.randn(batch, k)
    mod = DynamicLinear.from_float(nn.Sequential(lin, nn.ReLU()) if relu else lin, engine=engine,
                                   per_channel=per_channel)
    w_q = fake_quant(lin.weight.detach(), per_channel)
    ref = torch.nn.functional.linear(x, w_q, lin.bias.detach())
    ref = torch.relu(ref) if relu else ref
    qmax = 127 if mod.reduce_range else 255
    s_x = (max(x.max().item(), 0) - min(x.min().item(), 0)) / qmax
    bound = 2 * s_x * w_q.abs().sum(1) + 1e-5
    assert ((mod(x) - ref).abs() <= bound).all()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("flags,x86_reduces", [("avx2 fma", True), ("avx2 avx512f avx512bw avx512_vnni", False)])
def test_dynamic_linear_default_activation_bits_follow_the_cpu(engine, flags, x86_reduces):
    """Called directly, 7-bit activations only where fbgemm's pair sums saturate (no VNNI)."""
    with override_cpu_flags(flags):
        mod = DynamicLinear.from_float(nn.Linear(8, 4), engine=engine)
    assert mod.reduce_range is (x86_reduces and engine == "fbgemm")


@pytest.mark.parametrize("engine", ENGINES)
def test_dynamic_linear_fp16(engine):
    skip_unsupported(engine, torch.float16)
    lin, x = nn.Linear(32, 8), torch.randn(5, 32)
    ref = torch.nn.functional.linear(x, lin.weight.half().float(), lin.bias)
    assert torch.allclose(DynamicLinear.from_float(lin, dtype=torch.float16, engine=engine)(x), ref,
                          atol=1e-2)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("layers,bidirectional,batch_first,per_channel",
                         [(1, False, False, False), (2, True, True, True), (2, False, True, False)])
def test_dynamic_rnn(engine, dtype, kind, layers, bidirectional, batch_first, per_channel):
    skip_unsupported(engine, dtype)
    torch.manual_seed(0)
    rnn = getattr(nn, kind)(6, 5, num_layers=layers, bidirectional=bidirectional,
                            batch_first=batch_first)
    kernel = (DynamicLSTM if kind == "LSTM" else DynamicGRU).from_float(
        rnn, dtype=dtype, engine=engine, per_channel=per_channel)
    x = torch.randn(3, 4, 6)
    out, hidden = kernel(x)
    ref_out, ref_hidden = rnn(x)
    tol = 0.05 if dtype == torch.qint8 else 2e-3
    assert out.shape == ref_out.shape and torch.allclose(out, ref_out, atol=tol)
    for got, want in zip(hidden if kind == "LSTM" else (hidden,),
                         ref_hidden if kind == "LSTM" else (ref_hidden,)):
        assert torch.allclose(got, want, atol=tol)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("cell,kernel_cls", [(lambda: nn.LSTMCell(7, 5), LSTMCell),
                                             (lambda: nn.GRUCell(7, 5), GRUCell),
                                             (lambda: nn.RNNCell(7, 5), RNNCell),
                                             (lambda: nn.RNNCell(7, 5, bias=False,
                                                                 nonlinearity="relu"), RNNCell)])
def test_dynamic_cells(engine, dtype, cell, kernel_cls):
    skip_unsupported(engine, dtype)
    torch.manual_seed(1)
    float_cell, x = cell(), torch.randn(3, 7)
    kernel = kernel_cls.from_float(float_cell, dtype=dtype, engine=engine)
    tol = 0.05 if dtype == torch.qint8 else 2e-3
    for hx in (None, float_cell(x)):
        got, want = kernel(x, hx), float_cell(x, hx)
        for g, w in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,)):
            assert torch.allclose(g, w, atol=tol)


def test_dynamic_refusals():
    with pytest.raises(ConfigValidationError):
        DynamicLinear.from_float(nn.Linear(2, 2), dtype=torch.quint8, engine="fbgemm")
    if not engine_capabilities("qnnpack").fp16_dynamic_linear:
        with pytest.raises(ConstraintViolationError, match="float16"):
            DynamicLinear.from_float(nn.Linear(2, 2), dtype=torch.float16, engine="qnnpack")
    with pytest.raises(ConstraintViolationError, match="proj_size"):
        DynamicLSTM.from_float(nn.LSTM(4, 4, proj_size=2), engine="fbgemm")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("layer, kernel_cls", [
    (lambda: nn.LSTM(6, 5, num_layers=2, bidirectional=True), DynamicLSTM),
    (lambda: nn.GRUCell(6, 5), GRUCell),
])
def test_recurrent_kernels_pack_each_matrix_with_its_own_qparams(engine, layer, kernel_cls):
    """Given a QParams per weight matrix by name, each matrix is packed with its own: a layer whose
    weights already lie on those grids (a reference form's) gives the same kernel, bit for bit."""
    torch.manual_seed(0)
    float_layer, x = layer(), torch.randn(3, 6)
    names = [n for n, _ in float_layer.named_parameters() if n.startswith("weight")]
    qparams = {}
    for i, name in enumerate(names):  # each its own scales, range and granularity
        weight = getattr(float_layer, name).detach()
        seven_bit = i % 2 == 1
        scale = weight.abs().amax(1) / 63.5 if seven_bit else weight.abs().max() / (100 + i)
        low, high = (-64, 63) if seven_bit else (-128, 127)
        qparams[name] = QParams(scale, torch.zeros_like(scale, dtype=torch.int64), torch.qint8, low, high,
                                axis=0 if seven_bit else None)
    kernel = kernel_cls.from_float(float_layer, engine=engine, weight_qparams=qparams)
    rounded = rounded_copy(float_layer, qparams)
    assert not torch.equal(rounded.get_parameter(names[0]), float_layer.get_parameter(names[0]))
    again = kernel_cls.from_float(rounded, engine=engine, weight_qparams=qparams)
    x = x.unsqueeze(0) if kernel_cls is DynamicLSTM else x
    for got, expected in zip(_flat(kernel(x)), _flat(again(x)), strict=True):
        assert torch.equal(got, expected)
    with pytest.raises(ConfigValidationError, match=r"names \['weight'\], which .* does not have; its weight "
                                                    r"matrices: \['weight_ih"):
        kernel_cls.from_float(float_layer, engine=engine, weight_qparams=qparams[names[0]])


def _flat(value) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else [t for v in value for t in _flat(v)]


def rowwise_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit per-row (scale, min) quantization: the dequantized table and each row's LSB."""
    lo, hi = weight.min(1, keepdim=True).values, weight.max(1, keepdim=True).values
    scale = ((hi - lo) / 255).clamp(min=1e-8)
    return torch.round((weight - lo) / scale) * scale + lo, scale


@pytest.mark.parametrize("engine", ENGINES)
@CI
@given(num=st.integers(1, 30), dim=st.integers(1, 16), shape=st.lists(st.integers(1, 4), max_size=2),
       seed=st.integers(0, 2**16))
def test_embedding(engine, num, dim, shape, seed):
    torch.manual_seed(seed)
    emb = nn.Embedding(num, dim)
    idx = torch.randint(0, num, shape or [3])
    table, lsb = rowwise_reference(emb.weight.detach())
    out = Embedding.from_float(emb, engine=engine)(idx)
    assert out.shape == (*idx.shape, dim)
    assert ((out - table[idx]).abs() <= lsb[idx] * 1.01).all()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag(engine, mode, include_last_offset):
    torch.manual_seed(3)
    bag = nn.EmbeddingBag(20, 6, mode=mode, include_last_offset=include_last_offset)
    kernel = EmbeddingBag.from_float(bag, engine=engine)
    idx = torch.randint(0, 20, (11,))
    offsets = torch.tensor([0, 4, 4, 9] + ([11] if include_last_offset else []))
    table, lsb = rowwise_reference(bag.weight.detach())
    ref_bag = nn.EmbeddingBag.from_pretrained(table, mode=mode, include_last_offset=include_last_offset)
    tol = lsb.max() * 4
    assert torch.allclose(kernel(idx, offsets), ref_bag(idx, offsets), atol=tol)
    assert torch.allclose(kernel(idx[:10].view(2, 5)), ref_bag(idx[:10].view(2, 5)), atol=tol)
    with pytest.raises(ConstraintViolationError):
        EmbeddingBag.from_float(nn.EmbeddingBag(4, 2, mode="max"))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag_leaves_padding_out_of_the_sum_and_the_count(engine, mode, weighted, include_last_offset):
    """As nn.EmbeddingBag: padding_idx entries add nothing (even a non-zero padding row) and do not
    count in a mean; bags of padding only are zero. The kernel once summed and counted them."""
    torch.manual_seed(3)
    bag = nn.EmbeddingBag(20, 6, mode=mode, include_last_offset=include_last_offset, padding_idx=7)
    with torch.no_grad():
        bag.weight[7].normal_()
    kernel = EmbeddingBag.from_float(bag, engine=engine)
    idx = torch.tensor([7, 2, 3, 7, 7, 7, 5, 9, 7, 1, 7])
    offsets = torch.tensor([0, 4, 4, 6] + ([11] if include_last_offset else []))
    weights = torch.rand(11) if weighted else None
    table, lsb = rowwise_reference(bag.weight.detach())
    ref_bag = nn.EmbeddingBag.from_pretrained(table, mode=mode, include_last_offset=include_last_offset,
                                              padding_idx=7)
    tol = lsb.max() * 4
    assert torch.allclose(kernel(idx, offsets, weights), ref_bag(idx, offsets, weights), atol=tol)
    fixed, fixed_weights = idx[:10].view(2, 5), None if weights is None else weights[:10].view(2, 5)
    assert torch.allclose(kernel(fixed, None, fixed_weights), ref_bag(fixed, None, fixed_weights), atol=tol)
