"""Properties of the qparams maths (reliability guarantees G1-G4).

Each hypothesis example draws a small recipe (shape, seed, magnitude, offset) and builds the tensor
with torch, which keeps an example cheap enough for a thousand per dtype x scheme.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qplug_core.errors import ConfigValidationError, NonFiniteCalibrationError
from qplug_core.observers import MinMaxObserver, PerChannelMinMaxObserver
from qplug_core.qparams import (
    STORAGE_DTYPE,
    QParams,
    compute_qparams,
    dequantize,
    fake_quantize,
    quant_range,
    quantize,
)

EPS32 = float(np.finfo(np.float32).eps)
LIMIT = float(np.float32(1e37))  # the largest magnitude G4 covers, as a float32
DTYPES = (torch.quint8, torch.qint8)
SCHEMES = ("affine", "symmetric")
G1_SETTINGS = settings(max_examples=1000, derandomize=True, deadline=None)
FEW = settings(max_examples=300, derandomize=True, deadline=None)


@st.composite
def recipes(draw: st.DrawFn) -> dict:
    ndim = draw(st.integers(1, 5))
    shape = []
    for _ in range(ndim):
        budget = 4096 // max(1, math.prod(shape))
        shape.append(draw(st.integers(1, max(1, min(16, budget)))))
    return dict(shape=tuple(shape), seed=draw(st.integers(0, 2**31 - 1)),
                log_magnitude=draw(st.floats(-8, 8)), offset=draw(st.floats(-3, 3)),
                reduce_range=draw(st.booleans()), per_channel=draw(st.booleans()),
                axis=draw(st.integers(0, 4)))


def _tensor(recipe: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(recipe["seed"])
    x = torch.randn(recipe["shape"], generator=g) + recipe["offset"]
    return x * 10.0 ** recipe["log_magnitude"]


def _observer(dtype: torch.dtype, scheme: str, recipe: dict, ndim: int):
    if recipe["per_channel"]:
        qscheme = getattr(torch, f"per_channel_{scheme}")
        return PerChannelMinMaxObserver(ch_axis=recipe["axis"] % ndim, dtype=dtype,
                                        qscheme=qscheme, reduce_range=recipe["reduce_range"]
                                        and dtype == torch.qint8)
    qscheme = getattr(torch, f"per_tensor_{scheme}")
    reduce_range = recipe["reduce_range"] and not (dtype == torch.quint8 and scheme == "symmetric")
    return MinMaxObserver(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)


def _reference_qparams(lo: np.ndarray, hi: np.ndarray, dtype: torch.dtype, scheme: str,
                       qmin: int, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """The textbook formulas (seed document), evaluated independently in numpy float32."""
    f32 = np.float32
    lo, hi = np.minimum(lo.astype(f32), f32(0)), np.maximum(hi.astype(f32), f32(0))
    if scheme == "symmetric":
        scale = np.maximum(np.maximum(-lo, hi) / f32((qmax - qmin) / 2), f32(EPS32))
        return scale, np.full(lo.shape, 128 if dtype == torch.quint8 else 0)
    scale = np.maximum((hi - lo) / f32(qmax - qmin), f32(EPS32))
    zero_point = qmin - np.round(lo / scale).astype(np.int64)
    return scale, np.clip(zero_point, qmin, qmax)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x.abs(), torch.tensor(float("inf"))) - x.abs()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@G1_SETTINGS
@given(recipe=recipes())
def test_round_trip_saturation_and_exact_zero(dtype: torch.dtype, scheme: str,
                                              recipe: dict) -> None:
    """G1 (error <= scale/2 + 4 ulp in range), G2 (saturation up to 1e30), G3 (zero is exact),
    and the observer's qparams equal the formulas."""
    x = _tensor(recipe)
    obs = _observer(dtype, scheme, recipe, x.dim())
    obs(x)
    qp = obs.qparams()

    # the observer's qparams are the formulas applied to the observed range
    rows = x.reshape(1, -1) if qp.axis is None else \
        x.movedim(qp.axis, 0).reshape(x.shape[qp.axis], -1)
    scale, zero_point = _reference_qparams(rows.amin(1).numpy(), rows.amax(1).numpy(), dtype,
                                           scheme, qp.quant_min, qp.quant_max)
    assert np.array_equal(qp.scale.reshape(-1).numpy(), scale)
    assert np.array_equal(qp.zero_point.reshape(-1).numpy(), zero_point)

    # G1: every observed value is within half a step (plus rounding) after the round trip
    q = quantize(x, qp)
    assert q.dtype == STORAGE_DTYPE[dtype]
    err = (dequantize(q, qp) - x).abs()
    scale = qp.scale if qp.axis is None else qp.scale.reshape(
        [-1 if d == qp.axis else 1 for d in range(x.dim())])
    assert bool((err <= scale / 2 + 4 * _ulp(x)).all())
    assert torch.equal(fake_quantize(x, qp), dequantize(q, qp))

    # G2: far out of range saturates at qmin / qmax, never wraps
    extremes = torch.where(x >= 0, 1e30, -1e30)
    expected = torch.where(x >= 0, qp.quant_max, qp.quant_min)
    assert torch.equal(quantize(extremes, qp).to(torch.int64), expected)

    # G3: zero is exact
    assert bool((dequantize(quantize(x * 0.0, qp), qp) == 0.0).all())


@pytest.mark.parametrize("qscheme", [torch.per_tensor_affine, torch.per_tensor_symmetric], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=500, derandomize=True, deadline=None)
@given(value=st.one_of(st.just(0.0), st.floats(-LIMIT, LIMIT, width=32)))
def test_constant_tensors_are_safe(dtype: torch.dtype, qscheme: torch.qscheme,
                                   value: float) -> None:
    """G4: zero gives scale = float32 eps; a constant c round-trips within scale/2; all finite."""
    obs = MinMaxObserver(dtype=dtype, qscheme=qscheme)
    x = torch.full((3, 5), value)
    obs(x)
    qp = obs.qparams()
    assert math.isfinite(qp.scale.item()) and qp.scale.item() > 0
    if value == 0.0:
        assert qp.scale.item() == EPS32 == float(np.float32(1.1920929e-07))
    err = (dequantize(quantize(x, qp), qp) - x).abs()
    assert bool((err <= qp.scale / 2 + 4 * _ulp(x)).all())


@FEW
@given(lo=st.floats(-LIMIT, LIMIT, width=32), hi=st.floats(-LIMIT, LIMIT, width=32),
       symmetric=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_no_nonfinite_qparams_for_finite_ranges(lo: float, hi: float, symmetric: bool,
                                                dtype: torch.dtype) -> None:
    lo, hi = min(lo, hi), max(lo, hi)
    qmin, qmax = quant_range(dtype)
    scale, zero_point = compute_qparams(
        torch.tensor(lo), torch.tensor(hi), dtype=dtype,
        qscheme=torch.per_tensor_symmetric if symmetric else torch.per_tensor_affine,
        quant_min=qmin, quant_max=qmax)
    assert math.isfinite(scale.item()) and scale.item() >= EPS32
    assert qmin <= zero_point.item() <= qmax


def test_non_finite_scale_raises() -> None:
    with pytest.raises(NonFiniteCalibrationError, match="non-finite scale"):
        compute_qparams(torch.tensor(-3.4e38), torch.tensor(3.4e38), dtype=torch.quint8,
                        qscheme=torch.per_tensor_affine, quant_min=0, quant_max=255)


@FEW
@given(recipe=recipes(), dtype=st.sampled_from(DTYPES), symmetric=st.booleans())
def test_per_channel_equals_per_tensor_channel_by_channel(recipe: dict, dtype: torch.dtype,
                                                          symmetric: bool) -> None:
    x = _tensor(recipe)
    axis = recipe["axis"] % x.dim()
    scheme = "symmetric" if symmetric else "affine"
    obs = PerChannelMinMaxObserver(ch_axis=axis, dtype=dtype,
                                   qscheme=getattr(torch, f"per_channel_{scheme}"))
    obs(x)
    qp = obs.qparams()
    q, fq = quantize(x, qp), fake_quantize(x, qp)
    for c in range(x.shape[axis]):
        channel_qp = QParams(qp.scale[c], qp.zero_point[c], dtype, qp.quant_min, qp.quant_max)
        xc = x.select(axis, c)
        assert torch.equal(q.select(axis, c), quantize(xc, channel_qp))
        assert torch.equal(fq.select(axis, c), fake_quantize(xc, channel_qp))


@FEW
@given(recipe=recipes(), dtype=st.sampled_from(DTYPES))
def test_fake_quantize_equals_torch_kernels(recipe: dict, dtype: torch.dtype) -> None:
    """Same values as torch's fake-quant ops (which multiply by 1/scale and round half to even)."""
    x = _tensor(recipe)
    obs = MinMaxObserver(dtype=dtype)
    obs(x)
    qp = obs.qparams()
    expected = torch.fake_quantize_per_tensor_affine(x, qp.scale.item(), int(qp.zero_point),
                                                     qp.quant_min, qp.quant_max)
    assert torch.equal(fake_quantize(x, qp), expected)


def test_fake_quantize_keeps_nan_where_torch_gives_quant_min() -> None:
    """The one documented difference from torch's op: a diverged QAT run shows its NaN, and infinities
    saturate as in torch."""
    qp = QParams(torch.tensor(0.1), torch.tensor(3), torch.quint8, 0, 255)
    x = torch.tensor([float("nan"), 1.0, float("inf"), -float("inf")])
    got, torchs = fake_quantize(x, qp), torch.fake_quantize_per_tensor_affine(x, 0.1, 3, 0, 255)
    assert got[0].isnan() and torchs[0] == -0.3
    assert torch.equal(got[1:], torchs[1:])


def test_fake_quantize_gradient_is_straight_through() -> None:
    qp = QParams(torch.tensor(0.1), torch.tensor(10), torch.quint8, 0, 255)
    x = torch.tensor([-5.0, -1.0, 0.0, 0.04, 24.5, 30.0], requires_grad=True)
    fake_quantize(x, qp).sum().backward()
    # representable range is [-1.0, 24.5]
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_seed_worked_example() -> None:
    """The Linear weight of the seed document: symmetric qint8 gives scale 0.0043458822, zp 0."""
    w = torch.tensor([[0.4097, -0.2896, -0.4931], [-0.3738, -0.5541, 0.3243]])
    obs = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    obs(w)
    scale, zero_point = obs.calculate_qparams()
    assert scale.item() == pytest.approx(0.0043458822, abs=1e-10)
    assert scale.item() == float(np.float32(0.5541) / np.float32(127.5))
    assert zero_point.tolist() == [0]
    q = quantize(w, obs.qparams())
    assert q.tolist() == [[94, -67, -113], [-86, -128, 75]]


@pytest.mark.parametrize("dtype,reduce_range,expected", [
    (torch.quint8, False, (0, 255)), (torch.quint8, True, (0, 127)),
    (torch.qint8, False, (-128, 127)), (torch.qint8, True, (-64, 63)),
    (torch.qint32, False, (-(2**31), 2**31 - 1)), (torch.qint32, True, (-(2**31), 2**31 - 1)),
])
def test_quant_range_defaults(dtype: torch.dtype, reduce_range: bool, expected: tuple) -> None:
    assert quant_range(dtype, reduce_range) == expected


def test_quant_range_custom_is_halved_by_reduce_range() -> None:
    assert quant_range(torch.quint8, False, 0, 127) == (0, 127)
    assert quant_range(torch.quint8, True, 0, 255) == (0, 127)
    assert quant_range(torch.qint8, True, -127, 127) == (-64, 63)


@pytest.mark.parametrize("kwargs,field", [
    (dict(dtype=torch.quint8, quant_min=10, quant_max=5), "quant_min"),
    (dict(dtype=torch.quint8, quant_min=5, quant_max=10), "quant_min"),
    (dict(dtype=torch.quint8, quant_min=0, quant_max=256), "quant_max"),
    (dict(dtype=torch.qint8, quant_min=-129, quant_max=0), "quant_min"),
    (dict(dtype=torch.qint8, quant_min=0), "quant_max"),
    (dict(dtype=torch.float16), "dtype"),
])
def test_quant_range_rejects_bad_ranges(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigValidationError) as info:
        quant_range(**kwargs)
    assert info.value.field == field


def test_float_qparams_scheme() -> None:
    """Embedding scheme: zero point is a float, -min/scale, and 0 is not forced into the range."""
    scale, zero_point = compute_qparams(
        torch.tensor([1.0, -2.0]), torch.tensor([3.0, 2.0]), dtype=torch.quint8,
        qscheme=torch.per_channel_affine_float_qparams, quant_min=0, quant_max=255)
    assert scale.tolist() == pytest.approx([2.0 / 255, 4.0 / 255])
    assert zero_point.dtype == torch.float32
    assert zero_point.tolist() == pytest.approx([-127.5, 127.5])
    qp = QParams(scale, zero_point, torch.quint8, 0, 255, axis=0)
    x = torch.tensor([[1.0, 3.0], [-2.0, 2.0]])
    assert torch.allclose(dequantize(quantize(x, qp), qp), x, atol=1e-6)


def test_per_channel_shape_mismatch_is_a_config_error() -> None:
    qp = QParams(torch.ones(3), torch.zeros(3, dtype=torch.int64), torch.qint8, -128, 127, axis=1)
    with pytest.raises(ConfigValidationError, match="3 scales"):
        quantize(torch.zeros(2, 4), qp)
    with pytest.raises(ConfigValidationError, match="axis 5"):
        quantize(torch.zeros(2, 3), QParams(qp.scale, qp.zero_point, torch.qint8, -128, 127,
                                            axis=5))


@pytest.mark.parametrize("dtype, zero_point", [(torch.quint8, 128), (torch.qint8, 0)])
def test_nan_quantizes_to_quant_max_as_torchs_kernels_do(dtype, zero_point) -> None:
    """The reference form sent NaN to 0 (quint8: quant_min), torch's quantize_per_tensor (fbgemm and
    qnnpack) to quant_max, so the reference form and the kernels it checks answered differently."""
    x = torch.tensor([float("nan"), 0.15, float("inf"), -float("inf"), 1e30, -0.0])
    low, high = quant_range(dtype)
    ours = quantize(x, QParams(torch.tensor(0.1), torch.tensor(zero_point), dtype, low, high))
    for engine in ("fbgemm", "qnnpack"):
        torch.backends.quantized.engine, previous = engine, torch.backends.quantized.engine
        try:
            theirs = torch.quantize_per_tensor(x, 0.1, zero_point, dtype).int_repr()
        finally:
            torch.backends.quantized.engine = previous
        assert torch.equal(ours, theirs)
    assert int(ours[0]) == high
#: qint32 corner values: around 2**31 (float32 rounds 2**31 - 1 up), far out, infinite, midpoints
QINT32_CORNERS = [1e9, 2.1e9, 2147483520.0, 2147483647.0, 2147483648.0, 3e9, 1e18, 1e30, math.inf,
                  -3e9, -2147483648.0, -2147483904.0, -1e30, -math.inf, 0.5, 1.5, 2.5, -0.5, -2.5, 7.0]


@pytest.mark.parametrize(("scale", "zero_point"), [(1.0, 0), (1.0, 5), (0.5, -7), (3.0, 100), (1e-7, 0)])
def test_qint32_saturates_bit_for_bit_like_torch(scale: float, zero_point: int) -> None:
    """G2 for qint32: above the range gives 2**31 - 1 and below it -2**31 (3e9 used to wrap to
    -2**31), every value as torch.quantize_per_tensor / per_channel, and so do the ops."""
    x = torch.tensor(QINT32_CORNERS)
    qmin, qmax = quant_range(torch.qint32)
    per_tensor = QParams(torch.tensor(scale), torch.tensor(zero_point), torch.qint32, qmin, qmax)
    want = torch.quantize_per_tensor(x, scale, zero_point, torch.qint32).int_repr()
    assert torch.equal(quantize(x, per_tensor), want)
    assert torch.equal(torch.ops.qplug.quantize_per_tensor(x, per_tensor.scale, per_tensor.zero_point,
                                                           qmin, qmax, torch.int32), want)
    columns = x.reshape(-1, 1).repeat(1, 2)
    scales, zero_points = torch.tensor([scale, 2 * scale]), torch.tensor([zero_point, -zero_point])
    per_channel = QParams(scales, zero_points, torch.qint32, qmin, qmax, axis=1)
    want = torch.quantize_per_channel(columns, scales.double(), zero_points, 1, torch.qint32).int_repr()
    assert torch.equal(quantize(columns, per_channel), want)
    assert torch.equal(torch.ops.qplug.quantize_per_channel(columns, scales, zero_points, 1, qmin, qmax,
                                                            torch.int32), want)
    extremes = torch.tensor([1e30, 3e9 * scale, -1e30, -3e9 * scale])
    assert quantize(extremes, per_tensor).tolist() == [qmax, qmax, qmin, qmin]
