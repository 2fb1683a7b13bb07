"""Engines, warnings and overflow guards of the kernels (G12, reliability rows 31-33)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kernel_reference import ENGINES, qparams, random_activation
from torch import nn

from qplug_core.errors import NumericOverflowError
from qplug_core.kernels.base import KernelContext, TensorArg
from qplug_core.kernels.capabilities import engine_capabilities
from qplug_core.kernels.torch_int8 import (
    MAX_REDUCTION_U8S8,
    PASSTHROUGH_OPS,
    STATIC_KERNELS,
    Conv2d,
    DynamicLinear,
    Linear,
    passthrough_ops,
)

ROOT = Path(__file__).resolve().parents[3]


def linear_ctx(mod: nn.Module, engine: str, in_scale: float = 0.05, w_scale: float = 0.01
               ) -> KernelContext:
    return KernelContext(pattern="p", module=mod, target=None, args=(TensorArg(0),),
                         input_qparams=(qparams(in_scale, 0),), output_qparams=qparams(0.05, 128),
                         weight_qparams=qparams(w_scale, 0, torch.qint8), engine=engine)


def test_reduction_length_limit_g12():
    assert MAX_REDUCTION_U8S8 == 65_793
    Linear.from_context(linear_ctx(nn.Linear(65_793, 1), "fbgemm"))
    with pytest.raises(NumericOverflowError, match="65794"):
        Linear.from_context(linear_ctx(nn.Linear(65_794, 1), "fbgemm"))
    with pytest.raises(NumericOverflowError):  # conv: K = in_channels/groups * prod(kernel)
        Conv2d.from_context(linear_ctx(nn.Conv2d(7_311, 1, 3), "qnnpack"))
    with pytest.raises(NumericOverflowError):
        DynamicLinear.from_float(nn.Linear(65_794, 1), engine="fbgemm")


@pytest.mark.parametrize("engine", ENGINES)
def test_int32_bias_overflow_row32(engine):
    """Tiny weights (1e-9) and bias 5.0: |b/(s_in*s_w)| ~ 1e13. fbgemm adds the bias in float;
    qnnpack would overflow its int32 bias, so the weight scale is raised (with a warning)."""
    lin = nn.Linear(8, 2)
    with torch.no_grad():
        lin.weight.fill_(1e-9)
        lin.bias.copy_(torch.tensor([5.0, -5.0]))
    ctx = linear_ctx(lin, engine, w_scale=1e-9 / 127)
    if engine_capabilities(engine).float_bias:
        mod = Linear.from_context(ctx)
    else:
        with pytest.warns(RuntimeWarning, match="bias would overflow"):
            mod = Linear.from_context(ctx)
    x = random_activation((3, 8), 0.05, 0, torch.Generator().manual_seed(0))
    assert torch.allclose(mod(x).dequantize(), lin(x.dequantize()).detach(), atol=0.05)


@pytest.mark.parametrize("engine", ENGINES)
def test_int32_bias_leaves_room_for_the_dot_product(engine):
    """Bias -1e5 on channel 1 (+1e5 on channel 0): qnnpack's raised weight scale used to put the
    int32 bias at -(2^31 - 1), so a dot product of the bias's sign overflowed the accumulator and
    the channel came out at +99560 on rows where it should be -1e5. Now the bias leaves room for
    the largest dot product, and every row is within a few output steps of the float result."""
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 4)
    with torch.no_grad():
        lin.weight.copy_(torch.randint(-127, 128, (4, 64), generator=gen) * (0.1 / 127))
        lin.bias.copy_(torch.tensor([1e5, -1e5, 0.5, -0.5]))
    ctx = KernelContext(pattern="p", module=lin, target=None, args=(TensorArg(0),),
                        input_qparams=(qparams(0.03, 128),), output_qparams=qparams(1000.0, 128),
                        weight_qparams=qparams(0.1 / 127, 0, torch.qint8), engine=engine)
    if engine_capabilities(engine).float_bias:
        mod = Linear.from_context(ctx)
    else:
        with pytest.warns(RuntimeWarning, match="bias would overflow"):
            mod = Linear.from_context(ctx)
    # rows whose dot product with channel 1's weights is as negative as it gets, and as positive
    signs = torch.sign(lin.weight[1]).detach()
    codes = torch.stack([128 - 127 * signs, 128 + 127 * signs, torch.full((64,), 128.0)]).to(torch.uint8)
    x = torch._make_per_tensor_quantized_tensor(codes, 0.03, 128)
    with torch.no_grad():
        got, want = mod(x).dequantize(), lin(x.dequantize())
    assert (got - want).abs().max() <= 3 * 1000.0


def test_engine_restored_and_both_engines_in_one_process():
    before = torch.backends.quantized.engine
    gen = torch.Generator().manual_seed(1)
    x = random_activation((4, 16), 0.05, 0, gen)
    lin = nn.Linear(16, 8)
    mods = {e: Linear.from_context(linear_ctx(lin, e)) for e in ENGINES}
    assert torch.backends.quantized.engine == before
    outs = {e: m(x).int_repr().int() for e, m in mods.items()}  # no engine switch to run
    assert (outs["fbgemm"] - outs["qnnpack"]).abs().max() <= 1
    dyn = {e: DynamicLinear.from_float(lin, engine=e) for e in ENGINES}
    for m in dyn.values():
        assert torch.allclose(m(x.dequantize()), lin(x.dequantize()), atol=0.05)
    assert torch.backends.quantized.engine == before


def test_capabilities_are_probed_and_cached():
    fb, qn = engine_capabilities("fbgemm"), engine_capabilities("qnnpack")
    assert fb.available and qn.available and engine_capabilities("fbgemm") is fb
    assert fb.float_bias and not qn.float_bias  # as measured by test_int32_bias_overflow_row32
    assert not engine_capabilities("no-such-engine").available
    assert set(passthrough_ops("fbgemm")) >= set(PASSTHROUGH_OPS)


def test_no_deprecation_warning_reaches_the_user():
    """A fresh process (warn-once state untouched) builds and runs kernels of every family."""
    script = textwrap.dedent("""
        import warnings, torch
        from torch import nn
        warnings.simplefilter("always")
        from qplug_core.kernels.base import KernelContext, TensorArg
        from qplug_core.kernels.torch_int8 import (Quantize, Dequantize, Linear, Add, DynamicLSTM,
            LSTMCell, Embedding)
        from qplug_core.qparams import QParams
        qp = lambda s, z, d=torch.quint8: QParams(torch.tensor(s), torch.tensor(z), d,
                                                  *((0, 255) if d == torch.quint8 else (-128, 127)))
        quant = Quantize(qp(0.05, 0))
        x = quant(torch.rand(2, 8))
        for engine in ("qnnpack", "fbgemm"):
            ctx = KernelContext(pattern="p", module=nn.Linear(8, 4), target=None, args=(TensorArg(0),),
                                input_qparams=(qp(0.05, 0),), output_qparams=qp(0.05, 128),
                                weight_qparams=qp(0.01, 0, torch.qint8), engine=engine)
            y = Linear.from_context(ctx)(x)
            add = Add.from_context(KernelContext(pattern="p", module=None, target=torch.add,
                args=(TensorArg(0), TensorArg(1)), input_qparams=(qp(0.05, 128),) * 2,
                output_qparams=qp(0.1, 128)))
            Dequantize()(add(y, y))
            DynamicLSTM.from_float(nn.LSTM(8, 4), engine=engine)(torch.randn(3, 2, 8))
            LSTMCell.from_float(nn.LSTMCell(8, 4), engine=engine)(torch.randn(2, 8))
        Embedding.from_float(nn.Embedding(5, 4))(torch.tensor([1, 2]))
        print("ran")
    """)
    proc = subprocess.run([sys.executable, "-W", "always", "-c", script], capture_output=True,
                          text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ran" in proc.stdout
    assert "deprecated" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("engine", ENGINES)
def test_every_static_kernel_self_test(engine):
    for name, kernel in STATIC_KERNELS.items():
        if name == "conv_transpose3d" and not engine_capabilities(engine).conv_transpose3d:
            continue  # refused at build (ConstraintViolationError), see test_constraint_refusals
        kernel.self_test(engine)
