"""QConfig: factories as plain data, validation of what users commonly pass by mistake."""

from __future__ import annotations

import functools

import pytest
import torch
from config_testkit import FakeObserver, json_round_trip

from qplug_core.config import QConfig
from qplug_core.errors import ConfigError, ConfigValidationError
from qplug_core.observers.factory import ObserverFactory


def test_class_is_wrapped_and_equality_is_by_value():
    q = QConfig(activation=FakeObserver, weight=FakeObserver.with_args(dtype=torch.qint8))
    assert q.activation == ObserverFactory(FakeObserver)
    assert q == QConfig(FakeObserver.with_args(), FakeObserver.with_args(dtype=torch.qint8))
    assert q != QConfig(FakeObserver, FakeObserver.with_args(dtype=torch.quint8))
    act, weight = q
    assert isinstance(act(), FakeObserver) and weight().kwargs == {"dtype": torch.qint8}
    assert QConfig(FakeObserver).weight is None
    with pytest.raises(AttributeError):
        q.activation = None  # type: ignore[misc]


@pytest.mark.parametrize("activation, weight, field, text", [
    (FakeObserver(), None, "QConfig.activation", r"FakeObserver.with_args\(...\)"),
    (FakeObserver, FakeObserver(), "QConfig.weight", "observer instance"),
    (functools.partial(FakeObserver, x=1), None, "QConfig.activation", "cannot be saved"),
    (None, FakeObserver, "QConfig.activation", "PlaceholderObserver"),
    (3, None, "QConfig.activation", "got 3"),
])
def test_invalid_qconfig_arguments(activation, weight, field, text):
    with pytest.raises(ConfigValidationError, match=text) as info:
        QConfig(activation, weight)
    assert info.value.field == field


def test_round_trip_with_dtypes_qschemes_and_nested_factories():
    q = QConfig(
        activation=FakeObserver.with_args(dtype=torch.quint8, reduce_range=True, quant_min=0, quant_max=127,
                                          eps=2 ** -12, averaging_constant=0.01),
        weight=FakeObserver.with_args(observer=FakeObserver.with_args(ch_axis=0), dtype=torch.qint8,
                                      qscheme=torch.per_channel_symmetric, bounds=(-127, 127)))
    assert json_round_trip(q) == q
    assert QConfig.from_dict(q.to_dict()).weight.kwargs["qscheme"] is torch.per_channel_symmetric


def test_round_trip_with_real_observers():
    minmax = pytest.importorskip("qplug_core.observers.minmax")
    q = QConfig(minmax.MinMaxObserver.with_args(reduce_range=True),
                minmax.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    doc = q.to_dict()
    assert doc["activation"]["class"] == "qplug_core.observers.minmax.MinMaxObserver"
    assert json_round_trip(q) == q


def test_unserialisable_kwarg_names_its_path():
    with pytest.raises(ConfigError) as info:
        QConfig(FakeObserver.with_args(callback=lambda: 0)).to_dict()
    assert info.value.field == "activation.kwargs.callback"


@pytest.mark.parametrize("doc, field", [
    ({"schema_version": 1}, "activation"),
    ({"schema_version": 1, "activation": {"class": "os.system"}}, "activation.class"),
    ({"schema_version": 1, "activation": {"class": "torch.nn.functional.relu"}}, "activation.class"),
    ({"schema_version": 1, "activation": {"class": "qplug_tests.config.FakeObserver", "kwarg": {}}},
     "activation.kwarg"),
    ({"schema_version": 1, "activation": {"class": "qplug_tests.config.FakeObserver",
                                          "kwargs": {"dtype": {"dtype": "torch.qint9"}}}},
     "activation.kwargs.dtype.dtype"),
    ({"schema_version": 1, "activation": None}, "activation"),
])
def test_bad_documents(doc, field):
    with pytest.raises(ConfigError) as info:
        QConfig.from_dict(doc)
    assert info.value.field == field
