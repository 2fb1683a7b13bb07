"""Port of PyTorch's ``test/quantization/core/test_workflow_module.py`` (observers, fake quant).

Translation: ``torch.ao.quantization.<Observer>`` -> ``qp.observers.<Observer>`` (same arguments);
hypothesis ``@given`` over sampled_from/booleans -> ``pytest.mark.parametrize`` over the same
finite sets (every combination instead of a sample); ``self.assertEqual`` with atol/rtol ->
``torch.testing.assert_close``.

Deliberate differences (docs/migrating.md): ``calculate_qparams()`` on an observer that saw no
data raises ``UncalibratedObserverError`` instead of returning scale 1.0 / zero point 0 with a
warning; ``FixedQParamsFakeQuantize`` takes an observer factory, not ``(scale, zero_point)``;
TorchScript (``torch.jit.script``) and the multi-GPU cases are not ported (qplug does not support
scripting observers; no GPU here).
"""

from __future__ import annotations

import io
import itertools
import math

import pytest
import torch

from qplug_core.errors import UncalibratedObserverError
from qplug_core.observers import (
    FakeQuantize,
    FixedQParamsFakeQuantize,
    FixedQParamsObserver,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
    default_per_channel_weight_observer,
)


def _round_trip_state_dict(obs):
    b = io.BytesIO()
    torch.save(obs.state_dict(), b)
    b.seek(0)
    loaded = torch.load(b)
    for key, value in obs.state_dict().items():
        torch.testing.assert_close(value, loaded[key])
    return loaded


PER_TENSOR = [(d, q, r) for d, q, r in itertools.product(
    (torch.qint8, torch.quint8), (torch.per_tensor_affine, torch.per_tensor_symmetric), (False, True))
    # reduce_range cannot be true for symmetric quantization with uint8
    if not (d == torch.quint8 and q == torch.per_tensor_symmetric and r)]


@pytest.mark.parametrize("qdtype, qscheme, reduce_range", PER_TENSOR)
def test_per_tensor_observers(qdtype, qscheme, reduce_range):
    observers = [MinMaxObserver(dtype=qdtype, qscheme=qscheme, reduce_range=reduce_range),
                 MovingAverageMinMaxObserver(averaging_constant=0.5, dtype=qdtype, qscheme=qscheme,
                                             reduce_range=reduce_range)]
    for myobs in observers:
        # upstream: calculate_qparams returns with a warning for observers with no data
        with pytest.raises(UncalibratedObserverError):
            myobs.calculate_qparams()
        if type(myobs) is MinMaxObserver:
            x = torch.tensor([1.0, 2.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            y = torch.tensor([4.0, 5.0, 5.0, 6.0, 7.0, 8.0])
        else:
            # moving averages of min/max for x and y match the extremes used for minmax
            x = torch.tensor([0.0, 2.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            y = torch.tensor([2.0, 5.0, 5.0, 6.0, 7.0, 10.0])
        myobs(x)
        result = myobs(y)
        torch.testing.assert_close(result, y)
        assert myobs.min_val.item() == 1.0
        assert myobs.max_val.item() == 8.0
        qparams = myobs.calculate_qparams()
        if reduce_range:
            if qscheme == torch.per_tensor_symmetric:
                ref_scale = 0.062745 * 255 / 127
                ref_zero_point = 0 if qdtype is torch.qint8 else 128
            else:
                ref_scale = 0.0313725 * 255 / 127
                ref_zero_point = -64 if qdtype is torch.qint8 else 0
        else:
            if qscheme == torch.per_tensor_symmetric:
                ref_scale = 0.062745
                ref_zero_point = 0 if qdtype is torch.qint8 else 128
            else:
                ref_scale = 0.0313725
                ref_zero_point = -128 if qdtype is torch.qint8 else 0
        assert qparams[1].item() == ref_zero_point
        assert abs(qparams[0].item() - ref_scale) <= 1e-5
        loaded_dict = _round_trip_state_dict(myobs)
        loaded_obs = MinMaxObserver(dtype=qdtype, qscheme=qscheme, reduce_range=reduce_range)
        loaded_obs.load_state_dict(loaded_dict)
        assert myobs.min_val == loaded_obs.min_val and myobs.max_val == loaded_obs.max_val
        for a, b in zip(myobs.calculate_qparams(), loaded_obs.calculate_qparams()):
            torch.testing.assert_close(a, b)


PER_CHANNEL = [(d, q, a, r) for d, q, a, r in itertools.product(
    (torch.qint8, torch.quint8),
    (torch.per_channel_affine, torch.per_channel_symmetric, torch.per_channel_affine_float_qparams),
    (0, 1, 2, 3), (False, True))
    if not (r and (q == torch.per_channel_affine_float_qparams
                   or (d == torch.quint8 and q == torch.per_channel_symmetric)))]


@pytest.mark.parametrize("qdtype, qscheme, ch_axis, reduce_range", PER_CHANNEL)
def test_per_channel_observers(qdtype, qscheme, ch_axis, reduce_range):
    observers = [PerChannelMinMaxObserver(reduce_range=reduce_range, ch_axis=ch_axis, dtype=qdtype,
                                          qscheme=qscheme),
                 MovingAveragePerChannelMinMaxObserver(averaging_constant=0.5, reduce_range=reduce_range,
                                                       ch_axis=ch_axis, dtype=qdtype, qscheme=qscheme)]
    for myobs in observers:
        with pytest.raises(UncalibratedObserverError):  # upstream: works for empty observers
            myobs.calculate_qparams()
        x = torch.tensor([[[[1.0, 2.0], [2.0, 2.5]], [[3.0, 4.0], [4.5, 6.0]]],
                          [[[-4.0, -3.0], [5.0, 5.0]], [[6.0, 3.0], [7.0, 8.0]]]])
        if type(myobs) is MovingAveragePerChannelMinMaxObserver:
            # scaling the input models a change in min/max across batches
            myobs(0.5 * x)
            result = myobs(1.5 * x)
            torch.testing.assert_close(result, 1.5 * x)
        else:
            result = myobs(x)
            torch.testing.assert_close(result, x)
        qparams = myobs.calculate_qparams()
        ref_min_vals = [[1.0, -4.0], [-4.0, 3.0], [-4.0, 2.0], [-4.0, -3.0]]
        ref_max_vals = [[6.0, 8.0], [5.0, 8.0], [6.0, 8.0], [7.0, 8.0]]
        per_channel_symmetric_ref_scales = [[0.04705882, 0.06274509], [0.03921569, 0.0627451],
                                            [0.04705882, 0.0627451], [0.05490196, 0.0627451]]
        per_channel_affine_ref_scales = [[0.02352941, 0.04705882], [0.03529412, 0.03137255],
                                         [0.03921569, 0.03137255], [0.04313726, 0.04313726]]
        per_channel_affine_qint8_zp = [[-128, -43], [-15, -128], [-26, -128], [-35, -58]]
        per_channel_affine_float_qparams_ref_scales = [[0.0196, 0.0471], [0.0353, 0.0196],
                                                       [0.0392, 0.0235], [0.0431, 0.0431]]
        per_channel_affine_quint8_zp = [[0, 85], [113, 0], [102, 0], [93, 70]]
        torch.testing.assert_close(myobs.min_val, torch.tensor(ref_min_vals[ch_axis]))
        torch.testing.assert_close(myobs.max_val, torch.tensor(ref_max_vals[ch_axis]))
        if qscheme == torch.per_channel_symmetric:
            ref_scales = per_channel_symmetric_ref_scales[ch_axis]
            ref_zero_points = [0, 0] if qdtype is torch.qint8 else [128, 128]
        elif qscheme == torch.per_channel_affine_float_qparams:
            ref_scales = per_channel_affine_float_qparams_ref_scales[ch_axis]
            ref_zero_points = [-1 * ref_min_vals[ch_axis][i] / ref_scales[i] for i in range(len(ref_scales))]
        else:
            ref_scales = per_channel_affine_ref_scales[ch_axis]
            ref_zero_points = (per_channel_affine_qint8_zp[ch_axis] if qdtype is torch.qint8
                               else per_channel_affine_quint8_zp[ch_axis])
        if reduce_range:
            ref_scales = [s * 255 / 127 for s in ref_scales]
            ref_zero_points = [math.floor(z / 2) for z in ref_zero_points]
        torch.testing.assert_close(qparams[0], torch.tensor(ref_scales, dtype=qparams[0].dtype),
                                   rtol=1e-5, atol=0.0001)
        if qscheme == torch.per_channel_affine_float_qparams:
            torch.testing.assert_close(qparams[1], torch.tensor(ref_zero_points, dtype=qparams[1].dtype),
                                       rtol=1e-5, atol=1)
        else:
            torch.testing.assert_close(qparams[1], torch.tensor(ref_zero_points, dtype=qparams[1].dtype))
        loaded_dict = _round_trip_state_dict(myobs)
        loaded_obs = PerChannelMinMaxObserver(reduce_range=reduce_range, ch_axis=ch_axis,
                                              dtype=qdtype, qscheme=qscheme)
        loaded_obs.load_state_dict(loaded_dict)
        torch.testing.assert_close(myobs.min_val, loaded_obs.min_val)
        torch.testing.assert_close(myobs.max_val, loaded_obs.max_val)
        for a, b in zip(myobs.calculate_qparams(), loaded_obs.calculate_qparams()):
            torch.testing.assert_close(a, b)


def test_histogram_observer_consistent_buffer_shape():
    obs = HistogramObserver()
    min_shape_before, max_shape_before = obs.min_val.shape, obs.max_val.shape
    for _ in range(2):
        obs(torch.randn(4, 4, 4, 4))
    assert min_shape_before == obs.min_val.shape
    assert max_shape_before == obs.max_val.shape


def test_histogram_observer_save_load_state_dict():
    obs1 = HistogramObserver()
    obs1(torch.randn(4, 4, 4, 4))
    obs2 = HistogramObserver()
    obs2.load_state_dict(obs1.state_dict())
    assert obs2.min_val.shape == torch.Size([])
    assert obs2.max_val.shape == torch.Size([])


@pytest.mark.parametrize("obs_cls", [MinMaxObserver, MovingAverageMinMaxObserver, PerChannelMinMaxObserver,
                                     MovingAveragePerChannelMinMaxObserver, HistogramObserver,
                                     FakeQuantize, FixedQParamsFakeQuantize])
def test_zero_numel(obs_cls):
    if obs_cls is FixedQParamsFakeQuantize:
        # upstream: FixedQParamsFakeQuantize(0.1, 0); qplug's takes the observer
        obs = obs_cls(observer=FixedQParamsObserver.with_args(scale=0.1, zero_point=0))
    else:
        obs = obs_cls()
    x = torch.tensor([])
    assert obs(x).numel() == 0  # verify no crash


@pytest.mark.parametrize("obs_class", [MinMaxObserver, PerChannelMinMaxObserver])
def test_memoryless(obs_class):
    obs = obs_class(memoryless=True)
    x = torch.randn((3, 3))
    obs(x)
    params = obs.calculate_qparams()
    for _ in range(20):
        obs(10 * torch.randn((3, 3)))
        assert any(not torch.equal(a, b) for a, b in zip(params, obs.calculate_qparams()))
        obs(x)
        assert all(torch.equal(a, b) for a, b in zip(params, obs.calculate_qparams()))


# upstream also runs symmetric quint8 with reduce_range (zero point 128, outside the reduced range
# 0..127); qplug's histogram observer refuses it, as its (and torch.ao's) min/max observers do
HISTOGRAM = PER_TENSOR


@pytest.mark.parametrize("qdtype, qscheme, reduce_range", HISTOGRAM)
def test_histogram_observer(qdtype, qscheme, reduce_range):
    myobs = HistogramObserver(bins=3, dtype=qdtype, qscheme=qscheme, reduce_range=reduce_range)
    with pytest.raises(UncalibratedObserverError):  # upstream: works for empty observers
        myobs.calculate_qparams()
    x = torch.tensor([2.0, 3.0, 4.0, 5.0], requires_grad=True)
    y = torch.tensor([5.0, 6.0, 7.0, 8.0])
    out_x = myobs(x)
    assert out_x.requires_grad
    myobs(y)
    assert myobs.min_val.item() == 2.0
    assert myobs.max_val.item() == 8.0
    torch.testing.assert_close(myobs.histogram, torch.tensor([2.0, 3.0, 3.0]))
    qparams = myobs.calculate_qparams()
    if reduce_range:
        if qscheme == torch.per_tensor_symmetric:
            ref_scale = 0.0470588 * 255 / 127
            ref_zero_point = 0
        else:
            ref_scale = 0.0235294 * 255 / 127
            ref_zero_point = -64 if qdtype is torch.qint8 else 0
    else:
        if qscheme == torch.per_tensor_symmetric:
            ref_scale = 0.0470588
            ref_zero_point = 0 if qdtype is torch.qint8 else 128
        else:
            ref_scale = 0.0235294
            ref_zero_point = -128 if qdtype is torch.qint8 else 0
    assert qparams[1].item() == ref_zero_point
    assert abs(qparams[0].item() - ref_scale) <= 1e-5
    loaded_dict = _round_trip_state_dict(myobs)
    loaded_obs = HistogramObserver(bins=3, dtype=qdtype, qscheme=qscheme, reduce_range=reduce_range)
    loaded_obs.load_state_dict(loaded_dict)
    assert myobs.min_val == loaded_obs.min_val and myobs.max_val == loaded_obs.max_val
    torch.testing.assert_close(myobs.histogram, loaded_obs.histogram)
    assert myobs.bins == loaded_obs.bins
    for a, b in zip(myobs.calculate_qparams(), loaded_obs.calculate_qparams()):
        torch.testing.assert_close(a, b)


def test_histogram_observer_one_sided():
    myobs = HistogramObserver(bins=8, dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=True)
    myobs(torch.tensor([0.0, 0.3, 1.2, 1.7]))
    myobs(torch.tensor([0.1, 1.3, 2.0, 2.7]))
    assert myobs.min_val.item() == 0
    assert myobs.calculate_qparams()[1].item() == 0


def test_histogram_observer_same_inputs():
    """Upstream expects min 2.0 / max 8.0 / histogram [2, 3, 3] (constant batches dropped, from an
    older torch). torch 2.13's own HistogramObserver keeps them (min 0.0, max 8.0); qplug must
    agree with torch 2.13, which is the oracle here."""
    import warnings
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from torch.ao.quantization import HistogramObserver as TorchHistogramObserver
    w = torch.ones(4, requires_grad=True)
    x = torch.zeros(4, requires_grad=True)
    y = torch.tensor([2.0, 3.0, 4.0, 5.0], requires_grad=True)
    z = torch.tensor([5.0, 6.0, 7.0, 8.0])
    observers = [cls(bins=3, dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, reduce_range=False)
                 for cls in (HistogramObserver, TorchHistogramObserver)]
    for obs in observers:
        for t in (w, x, x, y, z):
            obs(t)
    mine, theirs = observers
    assert (mine.min_val.item(), mine.max_val.item()) == (theirs.min_val.item(), theirs.max_val.item()) \
        == (0.0, 8.0)
    torch.testing.assert_close(mine.histogram, theirs.histogram)
    for a, b in zip(mine.calculate_qparams(), theirs.calculate_qparams()):
        torch.testing.assert_close(a, b, check_dtype=False)


@pytest.mark.parametrize("N, bins, dtype, qscheme, reduce_range", [
    (10, 256, torch.quint8, torch.per_tensor_affine, False),
    (1000, 512, torch.qint8, torch.per_tensor_symmetric, True),
    (1000, 2048, torch.quint8, torch.per_tensor_affine, True),
    (10, 1024, torch.qint8, torch.per_tensor_affine, False),
])
def test_histogram_observer_against_reference(N, bins, dtype, qscheme, reduce_range):
    """Upstream compares against a Python re-implementation of torch.ao's L2 search; the port
    compares against torch.ao's HistogramObserver itself (the same reference, in torch)."""
    import warnings
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from torch.ao.quantization import HistogramObserver as TorchHistogramObserver
    ref_obs = TorchHistogramObserver(bins=bins, dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)
    my_obs = HistogramObserver(bins=bins, dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)
    gen = torch.Generator().manual_seed(N + bins)
    for _ in range(10):
        X = torch.randn(N, generator=gen)
        my_obs(X)
        ref_obs(X)
    for a, b in zip(ref_obs.calculate_qparams(), my_obs.calculate_qparams()):
        torch.testing.assert_close(a, b, check_dtype=False)  # torch's zero point is int32


def test_fq_serializable_per_channel():
    observer = default_per_channel_weight_observer
    fq_module = FakeQuantize(observer, -128, 127)
    X = torch.tensor([[-5, -3.5, -2, 0, 3, 5, 7], [1, 3, 2, 5, 6.5, 8, 10]], dtype=torch.float32)
    fq_module(X)
    state_dict = fq_module.state_dict()
    torch.testing.assert_close(state_dict["scale"], torch.tensor([0.054902, 0.078431]), atol=1e-5, rtol=0)
    torch.testing.assert_close(state_dict["zero_point"], torch.tensor([0, 0], dtype=state_dict["zero_point"].dtype))
    _round_trip_state_dict(fq_module)
