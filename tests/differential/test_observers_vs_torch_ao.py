"""Our observers and fake-quant against torch.ao's on the same data: qparams must be identical.

Each case feeds a few hundred random tensors (varied shapes, magnitudes, offsets, skew, constant
and one-sided ones) through a fresh pair of observers and compares scale and zero point exactly.
"""

from __future__ import annotations

import itertools
import warnings
import zlib

import pytest
import torch

tq = pytest.importorskip("torch.ao.quantization")

from qplug_core import observers as ours  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

#: tensors per configuration; every observer class sees >= 200 across its configurations
N_TENSORS = 40
N_HISTOGRAM = 20  # torch.ao's search is slow; 7 configurations x 20 cases of 1-4 tensors, + 40 below
PER_TENSOR = [
    dict(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range, **qrange)
    for dtype, qscheme, reduce_range, qrange in itertools.product(
        (torch.quint8, torch.qint8), (torch.per_tensor_affine, torch.per_tensor_symmetric),
        (False, True), ({}, {"quant_min": 0, "quant_max": 127}))
    # symmetric quint8 + reduce_range is rejected (by torch.ao too)
    if not (dtype == torch.quint8 and qscheme == torch.per_tensor_symmetric and reduce_range)
    and not (dtype == torch.qint8 and qrange)
]


def _seed(*parts: str) -> int:
    """A seed that is stable across processes (unlike ``hash`` of strings)."""
    return zlib.crc32("/".join(parts).encode())


def _random_tensor(g: torch.Generator, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A tensor drawn from a mix of distributions that stress the qparams formulas."""
    if shape is None:
        ndim = int(torch.randint(1, 5, (1,), generator=g))
        shape = tuple(int(s) for s in torch.randint(1, 9, (ndim,), generator=g))
    kind = int(torch.randint(0, 6, (1,), generator=g))
    magnitude = 10.0 ** float(torch.empty(1).uniform_(-6, 6, generator=g))
    x = torch.randn(shape, generator=g)
    if kind == 1:
        x = x.abs()  # one-sided
    elif kind == 2:
        x = x + float(torch.randn(1, generator=g)) * 5  # offset
    elif kind == 3:
        x = torch.exp(x * 2)  # heavy right tail
    elif kind == 4:
        x = torch.full(shape, float(torch.randn(1, generator=g)))  # constant
    elif kind == 5:
        x = torch.where(torch.rand(shape, generator=g) < 0.02, x * 100, x)  # outliers
    return (x * magnitude).to(torch.float32)


def _same_qparams(mine: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor],
                  context: str) -> None:
    assert mine[0].dtype == torch.float32, context
    assert torch.equal(mine[0], ref[0].to(torch.float32)), (context, mine, ref)
    if ref[1].is_floating_point():
        assert torch.equal(mine[1], ref[1]), (context, mine, ref)
    else:
        assert torch.equal(mine[1].to(torch.int64), ref[1].to(torch.int64)), (context, mine, ref)


def _run_pair(ours_obs: torch.nn.Module, ref_obs: torch.nn.Module, batches: list[torch.Tensor],
              context: str) -> None:
    for x in batches:
        ours_obs(x)
        ref_obs(x)
    _same_qparams(ours_obs.calculate_qparams(), ref_obs.calculate_qparams(), context)


def _configs_id(cfg: dict) -> str:
    return "-".join(str(v).replace("torch.", "") for v in cfg.values())


@pytest.mark.parametrize("cfg", PER_TENSOR, ids=_configs_id)
@pytest.mark.parametrize("name", ["MinMaxObserver", "MovingAverageMinMaxObserver"])
def test_minmax_observers_match(name: str, cfg: dict) -> None:
    g = torch.Generator().manual_seed(_seed(name, _configs_id(cfg)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(N_TENSORS):
            batches = [_random_tensor(g) for _ in range(1 + i % 3)]
            _run_pair(getattr(ours, name)(**cfg), getattr(tq, name)(**cfg), batches, f"{name} #{i}")


PER_CHANNEL = [
    dict(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)
    for dtype, qscheme, reduce_range in itertools.product(
        (torch.quint8, torch.qint8),
        (torch.per_channel_affine, torch.per_channel_symmetric,
         torch.per_channel_affine_float_qparams), (False, True))
    if not (dtype == torch.quint8 and qscheme == torch.per_channel_symmetric and reduce_range)
]


@pytest.mark.parametrize("cfg", PER_CHANNEL, ids=_configs_id)
@pytest.mark.parametrize("name", ["PerChannelMinMaxObserver",
                                  "MovingAveragePerChannelMinMaxObserver"])
def test_per_channel_observers_match(name: str, cfg: dict) -> None:
    g = torch.Generator().manual_seed(_seed(name, _configs_id(cfg)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(N_TENSORS):
            # 2-d and up: torch.ao cannot observe 1-d tensors per channel (ours can)
            shape = tuple(int(s) for s in torch.randint(1, 7, (2 + i % 3,), generator=g))
            axis = i % len(shape)
            batches = [_random_tensor(g, shape) for _ in range(1 + i % 3)]
            _run_pair(getattr(ours, name)(ch_axis=axis, **cfg),
                      getattr(tq, name)(ch_axis=axis, **cfg), batches, f"{name} #{i} axis {axis}")


HISTOGRAM = [
    dict(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)
    for dtype, qscheme, reduce_range in itertools.product(
        (torch.quint8, torch.qint8), (torch.per_tensor_affine, torch.per_tensor_symmetric),
        (False, True))
    if not (dtype == torch.quint8 and qscheme == torch.per_tensor_symmetric and reduce_range)
] + [dict(dtype=torch.quint8, qscheme=torch.per_tensor_affine, quant_min=0, quant_max=127)]


@pytest.mark.parametrize("cfg", HISTOGRAM, ids=_configs_id)
def test_histogram_observer_matches(cfg: dict) -> None:
    """Several batches with growing, shrinking and shifted ranges exercise the re-binning."""
    g = torch.Generator().manual_seed(_seed(_configs_id(cfg)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(N_HISTOGRAM):
            batches = [_random_tensor(g) for _ in range(1 + i % 4)]
            _run_pair(ours.HistogramObserver(bins=256, **cfg),
                      tq.HistogramObserver(bins=256, **cfg), batches, f"histogram #{i}")


def test_histogram_observer_matches_with_default_bins() -> None:
    """The 2048-bin default on large tensors, the size activations have in practice."""
    g = torch.Generator().manual_seed(7)
    for i in range(30):
        batches = [_random_tensor(g, (4, 16, 16)) for _ in range(1 + i % 3)]
        _run_pair(ours.HistogramObserver(), tq.HistogramObserver(), batches, f"histogram #{i}")


def test_histogram_observer_search_without_early_break() -> None:
    """Heavy outliers make the search walk many quantile steps before the error rises."""
    g = torch.Generator().manual_seed(3)
    for i in range(10):
        x = torch.randn(20000, generator=g)
        x[:: 97 + i] *= 1000
        _run_pair(ours.HistogramObserver(), tq.HistogramObserver(), [x, x * 0.5 + 3], f"#{i}")


FAKE_QUANT = [
    ("default_fake_quant", {}), ("default_weight_fake_quant", {}),
    ("default_per_channel_weight_fake_quant", {"ch_axis": 0}),
    ("default_per_channel_weight_fake_quant", {"ch_axis": 1}),
    ("default_embedding_fake_quant", {}),
]


@pytest.mark.parametrize("factory,kwargs", FAKE_QUANT, ids=lambda v: str(v))
def test_fake_quantize_outputs_and_gradients_match(factory: str, kwargs: dict) -> None:
    g = torch.Generator().manual_seed(11)
    mine, ref = getattr(ours, factory)(**kwargs), getattr(tq, factory)(**kwargs)
    for step in range(100):
        # no constant batches: torch.ao's moving averages can then round min above max and fail
        x = torch.randn((6, 5, 4), generator=g) * (1 + step % 5) + step % 3
        x_mine, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_mine, y_ref = mine(x_mine), ref(x_ref)
        assert torch.equal(y_mine, y_ref), step
        upstream = torch.randn(y_ref.shape, generator=g)
        y_mine.backward(upstream)
        y_ref.backward(upstream)
        assert torch.equal(x_mine.grad, x_ref.grad), step
        _same_qparams((mine.scale, mine.zero_point), (ref.scale, ref.zero_point), str(step))
        if step == 50:  # freeze the statistics halfway, as QAT schedules do
            mine.apply(ours.disable_observer)
            ref.apply(tq.disable_observer)


def test_fixed_qparams_fake_quant_matches() -> None:
    for name in ("default_fixed_qparams_range_0to1_fake_quant",
                 "default_fixed_qparams_range_neg1to1_fake_quant"):
        mine, ref = getattr(ours, name)(), getattr(tq, name)()
        x = torch.linspace(-2, 2, 1001)
        assert torch.equal(mine(x), ref(x))
        _same_qparams(mine.calculate_qparams(), ref.calculate_qparams(), name)


def test_learnable_fake_quantize_matches_torch_lsq() -> None:
    """Outputs equal and gradients (input, scale, zero point) close to torch's LSQ kernel."""
    from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

    g = torch.Generator().manual_seed(5)
    for use_grad_scaling in (False, True):
        mine = ours.LearnableFakeQuantize(quant_min=0, quant_max=255,
                                          use_grad_scaling=use_grad_scaling)
        ref = _LearnableFakeQuantize(tq.MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                     use_grad_scaling=use_grad_scaling)
        x = torch.randn(64, generator=g) * 3
        mine(x), ref(x)  # initialise from the observer
        mine.enable_param_learning()
        ref.enable_param_learning()
        with torch.no_grad():
            mine.scale.mul_(0.7)
            ref.scale.mul_(0.7)
        x_mine, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_mine, y_ref = mine(x_mine), ref(x_ref)
        torch.testing.assert_close(y_mine, y_ref, rtol=0, atol=1e-6)
        y_mine.pow(2).sum().backward()
        y_ref.pow(2).sum().backward()
        torch.testing.assert_close(x_mine.grad, x_ref.grad)
        torch.testing.assert_close(mine.scale.grad, ref.scale.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.zero_point.grad, ref.zero_point.grad, rtol=1e-4, atol=1e-5)
