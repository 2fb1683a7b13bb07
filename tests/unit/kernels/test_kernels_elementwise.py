"""Element-wise, activation, norm and passthrough kernels vs a float reference, per engine.

These ops have no packed state: torch dispatches them on the global engine, so each case runs
under ``engine_context(engine)`` to exercise that engine's implementation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_reference import ENGINES, lsb_diff, output_qparams_covering, qparams, random_activation
from torch import nn

from qplug_core.errors import ConstraintViolationError
from qplug_core.kernels.base import KernelContext, TensorArg, engine_context
from qplug_core.kernels.passthrough import check_upsampling
from qplug_core.kernels.torch_int8 import (
    ELU,
    FIXED_QPARAMS,
    Add,
    AddReLU,
    BatchNorm2d,
    BatchNorm3d,
    Bmm,
    Cat,
    GroupNorm,
    Hardsigmoid,
    Hardswish,
    InstanceNorm,
    LayerNorm,
    LeakyReLU,
    Matmul,
    Mul,
    MulReLU,
    Sigmoid,
    SiLU,
    Softmax,
    Tanh,
)

CI = settings(derandomize=True, max_examples=15, deadline=None)
SHAPES = st.lists(st.integers(1, 5), min_size=2, max_size=4).map(tuple)
DTYPES = st.sampled_from([torch.quint8, torch.qint8])


def run(kernel_cls, ctx: KernelContext, reference, inputs, engine: str, max_lsb: int = 1) -> None:
    expected = reference(*(x.dequantize() for x in inputs))
    if ctx.output_qparams is None:
        ctx.output_qparams = output_qparams_covering(expected, inputs[0].dtype)
    ctx.engine = engine
    module = kernel_cls.from_context(ctx)
    with engine_context(engine):
        out = module(*inputs)
    assert lsb_diff(out, expected).max().item() <= max_lsb


def activation(shape, seed, dtype=torch.quint8, scale=0.03):
    zp = 100 if dtype == torch.quint8 else -20
    high = 255 if dtype == torch.quint8 else 127
    return random_activation(shape, scale, zp, torch.Generator().manual_seed(seed), high, dtype)


BINARY = [(Add, torch.add), (AddReLU, lambda a, b: torch.relu(a + b)), (Mul, torch.mul),
          (MulReLU, lambda a, b: torch.relu(a * b))]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kernel_cls,reference", BINARY)
@CI
@given(shape=SHAPES, dtype=DTYPES, seed=st.integers(0, 2**16))
def test_binary_tensor_tensor(engine, kernel_cls, reference, shape, dtype, seed):
    a, b = activation(shape, seed, dtype), activation(shape, seed + 1, dtype, scale=0.02)
    ctx = KernelContext(pattern="p", module=None, target=torch.add, args=(TensorArg(0), TensorArg(1)),
                        input_qparams=(qparams(a.q_scale(), a.q_zero_point(), dtype),
                                       qparams(b.q_scale(), b.q_zero_point(), dtype)))
    run(kernel_cls, ctx, reference, (a, b), engine)


def _conv1d_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a quantized Conv1d returns it: its 2-D conv's channels-last result squeezed to 3-D."""
    return x.unsqueeze(2).contiguous(memory_format=torch.channels_last).squeeze(2)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kernel_cls,reference", BINARY)
@pytest.mark.parametrize("layouts", ["conv1d outputs", "conv1d output and its slice"])
def test_binary_on_conv1d_layouts_equals_the_reference_in_the_same_layout(engine, kernel_cls, reference, layouts):
    """Two conv1d outputs go to torch's fast 4-D channels-last kernel (the 3-D strided one was 20x
    slower), a sliced operand is copied contiguous; values equal the reference, the 3-D shape stays."""
    a = _conv1d_layout(activation((2, 8, 40), 1))
    b = _conv1d_layout(activation((2, 8, 42 if "slice" in layouts else 40), 2, scale=0.02))
    if "slice" in layouts:
        b = b[..., :-2]
    assert not a.is_contiguous() and not b.is_contiguous()
    ctx = KernelContext(pattern="p", module=None, target=torch.add, args=(TensorArg(0), TensorArg(1)),
                        input_qparams=(qparams(a.q_scale(), a.q_zero_point()),
                                       qparams(b.q_scale(), b.q_zero_point())))
    run(kernel_cls, ctx, reference, (a, b), engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_matmul_of_two_conv1d_outputs_multiplies_them_as_3d(engine):
    """The add's 4-D view of Conv1d outputs is no matmul operand: (N, C, L) @ (N, L, M) stays 3-D."""
    a, b = _conv1d_layout(activation((2, 8, 6), 1)), _conv1d_layout(activation((2, 6, 5), 2, scale=0.02))
    ctx = KernelContext(pattern="p", module=None, target=torch.matmul, args=(TensorArg(0), TensorArg(1)),
                        input_qparams=(qparams(a.q_scale(), a.q_zero_point()),
                                       qparams(b.q_scale(), b.q_zero_point())))
    run(Matmul, ctx, torch.matmul, (a, b), engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("shapes", [((2, 2, 3, 4), (2, 2, 4, 5)), ((1, 3, 4), (2, 4, 5)), ((2, 3, 4), (4, 5))],
                         ids=["4-D", "other batch sizes", "a 2-D operand"])
def test_bmm_multiplies_what_torch_bmm_does_and_refuses_the_rest_as_it_does(engine, shapes):
    """quantized.matmul broadcasts and takes any rank; the int8 bmm must not answer where torch.bmm
    raises (a RuntimeError either way)."""
    a, b = activation((2, 3, 4), 1), activation((2, 4, 5), 2, scale=0.02)
    ctx = KernelContext(pattern="p", module=None, target=torch.bmm, args=(TensorArg(0), TensorArg(1)),
                        input_qparams=(qparams(a.q_scale(), a.q_zero_point()),
                                       qparams(b.q_scale(), b.q_zero_point())))
    run(Bmm, ctx, torch.bmm, (a, b), engine)
    wrong = activation(shapes[0], 3), activation(shapes[1], 4)
    with pytest.raises(RuntimeError):
        torch.bmm(*(x.dequantize() for x in wrong))
    with engine_context(engine), pytest.raises(RuntimeError, match=r"int8 bmm takes two 3-D tensors"):
        Bmm.from_context(ctx)(*wrong)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kernel_cls,reference", BINARY)
@pytest.mark.parametrize("shape,layout", [((2, 16, 4, 4), torch.channels_last),
                                          ((2, 8, 2, 4, 4), torch.channels_last_3d)])
def test_binary_on_channels_last_operands_keeps_the_layout_and_the_contiguous_values(
        engine, kernel_cls, reference, shape, layout):
    """Two conv outputs (channels-last) are added in place of being copied to NCHW: the result keeps
    their layout, so the pooling behind a ResNet add runs on its fast path, with the same codes as
    the contiguous operands give (512 elements: no vector tail, where torch rounds by another route)."""
    a, b = activation(shape, 1), activation(shape, 2, scale=0.02)
    ctx = KernelContext(pattern="p", module=None, target=torch.add, args=(TensorArg(0), TensorArg(1)),
                        input_qparams=(qparams(a.q_scale(), a.q_zero_point()),
                                       qparams(b.q_scale(), b.q_zero_point())))
    ctx.output_qparams = output_qparams_covering(reference(a.dequantize(), b.dequantize()), a.dtype)
    module = kernel_cls.from_context(ctx)
    with engine_context(engine):
        contiguous = module(a, b)
        out = module(a.contiguous(memory_format=layout), b.contiguous(memory_format=layout))
    assert out.is_contiguous(memory_format=layout) and not out.is_contiguous()
    assert torch.equal(out.int_repr(), contiguous.int_repr())


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kernel_cls,reference", BINARY)
@CI
@given(shape=SHAPES, scalar=st.sampled_from([-1.5, -0.25, 0.5, 2.0, 3]), seed=st.integers(0, 2**16))
def test_binary_tensor_scalar(engine, kernel_cls, reference, shape, scalar, seed):
    a = activation(shape, seed)
    ctx = KernelContext(pattern="p", module=None, target=torch.add, args=(TensorArg(0), scalar),
                        input_qparams=(qparams(a.q_scale(), a.q_zero_point()),))
    # the scalar ops keep the input's grid; the reference may differ by the op's own rounding
    run(kernel_cls, ctx, lambda x: reference(x, torch.tensor(float(scalar))), (a,), engine, max_lsb=2)


@pytest.mark.parametrize("engine", ENGINES)
@CI
@given(shape=SHAPES, dim=st.integers(0, 1), n=st.integers(2, 3), seed=st.integers(0, 2**16))
def test_cat(engine, shape, dim, n, seed):
    xs = [activation(shape, seed + i, scale=0.02 + 0.01 * i) for i in range(n)]
    ctx = KernelContext(pattern="p", module=None, target=torch.cat,
                        args=([TensorArg(i) for i in range(n)],), kwargs={"dim": dim},
                        input_qparams=tuple(qparams(x.q_scale(), x.q_zero_point()) for x in xs))
    run(Cat, ctx, lambda *t: torch.cat(t, dim), xs, engine)


UNARY = [(Hardswish, nn.Hardswish()), (SiLU, nn.SiLU()), (ELU, nn.ELU(0.5)), (LeakyReLU, nn.LeakyReLU(0.2)),
         (Softmax, nn.Softmax(dim=-1))]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kernel_cls,module", UNARY)
@CI
@given(shape=SHAPES, dtype=DTYPES, seed=st.integers(0, 2**16))
def test_unary(engine, kernel_cls, module, shape, dtype, seed):
    if kernel_cls is Softmax and (engine == "qnnpack" or dtype == torch.qint8):
        dtype = torch.quint8  # quantized softmax: quint8 only
    x = activation(shape, seed, dtype)
    ctx = KernelContext(pattern="p", module=module, target=type(module), args=(TensorArg(0),),
                        input_qparams=(qparams(x.q_scale(), x.q_zero_point(), dtype),))
    run(kernel_cls, ctx, module, (x,), engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kernel_cls,name,fn", [(Sigmoid, "sigmoid", torch.sigmoid),
                                                (Tanh, "tanh", torch.tanh),
                                                (Hardsigmoid, "hardsigmoid", F.hardsigmoid)])
@pytest.mark.parametrize("dtype", [torch.quint8, torch.qint8])
def test_fixed_qparams(engine, kernel_cls, name, fn, dtype):
    x = activation((4, 33), 5, dtype, scale=0.05)
    scale, zp = FIXED_QPARAMS[name][dtype]
    ctx = KernelContext(pattern="p", module=None, target=fn, args=(TensorArg(0),),
                        input_qparams=(qparams(x.q_scale(), x.q_zero_point(), dtype),),
                        output_qparams=qparams(scale, zp, dtype))
    run(kernel_cls, ctx, fn, (x,), engine)
    ctx.output_qparams = qparams(0.1, zp, dtype)
    with pytest.raises(ConstraintViolationError, match="fixed"):
        kernel_cls.from_context(ctx)


def _bn(dim: int, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    bn = getattr(nn, f"BatchNorm{dim}d")(3).eval()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5, generator=g)
        bn.bias.uniform_(-0.5, 0.5, generator=g)
        bn.running_mean.uniform_(-1, 1, generator=g)
        bn.running_var.uniform_(0.5, 2, generator=g)
    return bn


@pytest.mark.parametrize("engine", ENGINES)
@CI
@given(dim=st.sampled_from([2, 3]), relu=st.booleans(), n=st.integers(1, 3), size=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_batch_norm(engine, dim, relu, n, size, seed):
    bn = _bn(dim, seed)
    module = nn.Sequential(bn, nn.ReLU()) if relu else bn
    x = activation((n, 3) + (size,) * dim, seed)
    ctx = KernelContext(pattern="p", module=module, target=None, args=(TensorArg(0),),
                        input_qparams=(qparams(x.q_scale(), x.q_zero_point()),))
    run(BatchNorm3d if dim == 3 else BatchNorm2d, ctx, module, (x,), engine)


NORMS = [(LayerNorm, lambda: nn.LayerNorm([4, 5]), (3, 4, 5)),
         (GroupNorm, lambda: nn.GroupNorm(2, 4), (2, 4, 3, 3)),
         (InstanceNorm, lambda: nn.InstanceNorm2d(4, affine=True), (2, 4, 3, 3)),
         (InstanceNorm, lambda: nn.InstanceNorm1d(4), (2, 4, 7))]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kernel_cls,make,shape", NORMS)
@settings(derandomize=True, max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_norms(engine, kernel_cls, make, shape, seed):
    module = make()
    if getattr(module, "weight", None) is not None:
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            module.weight.uniform_(0.5, 1.5, generator=g)
            module.bias.uniform_(-0.5, 0.5, generator=g)
    x = activation(shape, seed)
    ctx = KernelContext(pattern="p", module=module, target=None, args=(TensorArg(0),),
                        input_qparams=(qparams(x.q_scale(), x.q_zero_point()),))
    run(kernel_cls, ctx, module, (x,), engine)


PASSTHROUGH_CASES = [
    ("max_pool2d", lambda x: F.max_pool2d(x, 2), 0), ("max_pool1d", lambda x: F.max_pool1d(x.flatten(2), 2), 0),
    ("avg_pool2d", lambda x: F.avg_pool2d(x, 2), 1), ("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, 1), 1),
    ("mean", lambda x: x.mean((2, 3)), 1), ("flatten", lambda x: torch.flatten(x, 1), 0),
    ("permute", lambda x: x.permute(0, 2, 3, 1), 0), ("relu6", F.relu6, 0),
    ("hardtanh", lambda x: F.hardtanh(x, -0.5, 0.5), 1), ("clamp", lambda x: torch.clamp(x, -0.5, 0.5), 1),
    ("interpolate", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), 1),
    ("chunk", lambda x: torch.chunk(x, 2, 1)[1], 0), ("dropout", lambda x: F.dropout(x, 0.5, False), 0),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [torch.quint8, torch.qint8])
@pytest.mark.parametrize("name,fn,max_lsb", PASSTHROUGH_CASES, ids=[c[0] for c in PASSTHROUGH_CASES])
def test_passthrough_ops_keep_qparams(engine, dtype, name, fn, max_lsb):
    x = activation((2, 4, 6, 6), 9, dtype)
    with engine_context(engine):
        out = fn(x)
    assert (out.q_scale(), out.q_zero_point()) == (x.q_scale(), x.q_zero_point())
    assert lsb_diff(out, fn(x.dequantize())).max().item() <= max_lsb


def _torch_refuses(x: torch.Tensor, engine: str, mode: str) -> bool:
    try:
        with engine_context(engine):
            F.interpolate(x, scale_factor=2, mode=mode)
    except NotImplementedError:
        return True
    return False


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", ["nearest", "nearest-exact", "bilinear", "area", "linear", "bicubic"])
@pytest.mark.parametrize("rank", [3, 4, 5])
def test_check_upsampling_refuses_what_torch_cannot_run_on_quantized_tensors(engine, mode, rank):
    """The check sees the example input's shape: a 1-d nearest was let through and failed the kernel
    contract's run at convert, whose warning blamed the plugin. torch is the oracle, rank by rank."""
    x = activation((1, 2, *(4,) * (rank - 2)), 3)
    ctx = KernelContext(pattern=F.interpolate, module=None, target=F.interpolate,
                        args=(TensorArg(0),), kwargs={"scale_factor": 2, "mode": mode},
                        input_shapes=(tuple(x.shape),))
    if not _torch_refuses(x, engine, mode):
        check_upsampling(ctx)
        return
    with pytest.raises(ConstraintViolationError, match="has no int8 kernel in torch") as refusal:
        check_upsampling(ctx)
    if mode == "nearest" and rank == 3:
        assert str(refusal.value) == (
            "upsampling mode 'nearest' in 1-d (a 3-d input) has no int8 kernel in torch (quantized tensors "
            "take it in 2-d and 3-d only), so it runs in float between a dequantize and a quantize")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("size", [(1, 1), (1, 3), (2, 2)])
def test_check_upsampling_refuses_bilinear_from_a_1x1_map_exactly_where_torch_is_wrong(engine, size):
    """DeepLab's global-pool branch: torch's int8 bilinear from a 1x1 map is up to 250 steps off;
    convert's contract caught it with a warning that read like a plugin bug. torch is the oracle."""
    x = activation((1, 8, *size), 3)
    with engine_context(engine):
        got = F.interpolate(x, size=(6, 6), mode="bilinear").int_repr().int()
    expected = torch.quantize_per_tensor(F.interpolate(x.dequantize(), size=(6, 6), mode="bilinear"),
                                         x.q_scale(), x.q_zero_point(), x.dtype).int_repr().int()
    wrong = bool((got - expected).abs().max() > 1)
    ctx = KernelContext(pattern=F.interpolate, module=None, target=F.interpolate, args=(TensorArg(0),),
                        kwargs={"size": (6, 6), "mode": "bilinear"}, input_shapes=(tuple(x.shape),))
    assert wrong == (size == (1, 1))
    if wrong:
        with pytest.raises(ConstraintViolationError, match="bilinear upsampling of a 1x1 map"):
            check_upsampling(ctx)
    else:
        check_upsampling(ctx)


def test_silu_keeps_a_conv1d_output_layout_and_its_values():
    """A Conv1d's int8 output (channels-last 4-D squeezed) stays in that layout for the next conv."""
    x = activation((2, 8, 1, 9), 0).contiguous(memory_format=torch.channels_last).squeeze(2)
    ctx = KernelContext(pattern="p", module=nn.SiLU(), target=nn.SiLU, args=(TensorArg(0),),
                        input_qparams=(qparams(x.q_scale(), x.q_zero_point()),))
    run(SiLU, ctx, nn.SiLU(), (x,), "fbgemm", max_lsb=0)
    ctx.output_qparams = output_qparams_covering(F.silu(x.dequantize()), x.dtype)
    assert SiLU.from_context(ctx)(x).stride() == x.stride()
