"""The reduction protocol without processes: which classes declare a rule, and the single-process
behaviour of the distributed entry points (nothing changes, or a clear error)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core import observers as obs
from qplug_core.errors import DistributedCalibrationError
from qplug_core.observers.ranks import declares_reduction

SHIPPED = [obs.MinMaxObserver, obs.MovingAverageMinMaxObserver, obs.PerChannelMinMaxObserver,
           obs.MovingAveragePerChannelMinMaxObserver, obs.HistogramObserver,
           obs.PercentileObserver, obs.MSEObserver, obs.FixedQParamsObserver,
           obs.PlaceholderObserver, obs.FakeQuantize, obs.FixedQParamsFakeQuantize,
           obs.LearnableFakeQuantize]


@pytest.mark.parametrize("cls", SHIPPED, ids=lambda c: c.__name__)
def test_every_shipped_class_declares_its_reduction(cls):
    assert declares_reduction(cls)


def test_base_classes_declare_nothing():
    assert not declares_reduction(obs.ObserverBase)
    assert not declares_reduction(obs.FakeQuantizeBase)


def test_a_subclass_that_gathers_statistics_differently_must_declare_again():
    class AbsMinMax(obs.MinMaxObserver):
        def forward(self, x):
            return super().forward(x.abs())

    class SmoothedHistogram(obs.HistogramObserver):
        def _update(self, x):  # a statistics hook the parent does not define
            pass

    class Declared(AbsMinMax):
        def reduce_across_ranks(self, ranks):
            obs.MinMaxObserver.reduce_across_ranks(self, ranks)

    class OtherRange(obs.HistogramObserver):  # same statistics, another clipping rule
        def _observed_range(self):
            return self.min_val, self.max_val

    assert not declares_reduction(AbsMinMax)
    assert not declares_reduction(SmoothedHistogram)
    assert declares_reduction(Declared)
    assert declares_reduction(OtherRange)


def test_undeclared_reduction_raises_naming_the_class():
    class PluginObserver(obs.ObserverBase):
        def forward(self, x):
            return x

    with pytest.raises(DistributedCalibrationError, match=r"\.PluginObserver does not declare"):
        PluginObserver().reduce_across_ranks(None)


def test_without_a_process_group_sync_does_nothing_and_calibrate_is_unchanged():
    observer = obs.MinMaxObserver()
    qp.calibrate(nn.Sequential(observer), [torch.tensor([1.0, -2.0]), torch.tensor([3.0])],
                 progress=False)
    assert qp.sync_observers(nn.Sequential(observer)) == 0
    assert (observer.min_val.item(), observer.max_val.item()) == (-2.0, 3.0)


@pytest.mark.parametrize("start", [
    lambda m: qp.distributed.sync_observers_each_step(m),
    lambda m: qp.distributed.data_parallel(m),
], ids=["sync_observers_each_step", "data_parallel"])
def test_entry_points_that_need_a_process_group_say_so(start):
    with pytest.raises(DistributedCalibrationError, match="no torch.distributed process group"):
        start(nn.Sequential(obs.MinMaxObserver()))


def test_data_parallel_refuses_buffer_broadcast_before_anything_else():
    with pytest.raises(qp.errors.ConfigValidationError, match="forward_sync_buffers=True would"):
        qp.distributed.data_parallel(nn.Sequential(obs.MinMaxObserver()), forward_sync_buffers=True)
