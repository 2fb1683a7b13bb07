"""``int_values`` / ``quantized_from_int``: a static kernel's quantized tensors with public torch API."""

from __future__ import annotations

import warnings

import pytest
import torch

from qplug_core.plugin_api import ConfigValidationError, int_values, quantized_from_int


@pytest.mark.parametrize("dtype, low, high", [(torch.quint8, 0, 255), (torch.qint8, -128, 127)])
@pytest.mark.parametrize("scale, zero_point", [(1e-4, 0), (0.0173, 17), (3.7, 100), (2.0 ** -8, 0)])
def test_every_integer_round_trips_exactly(dtype, low, high, scale, zero_point):
    zero_point = min(max(zero_point, low), high)
    values = torch.arange(low, high + 1)
    q = quantized_from_int(values, scale, zero_point, dtype)
    integers, got_scale, got_zero_point = int_values(q)
    assert torch.equal(integers.long(), values)
    assert (q.dtype, got_zero_point) == (dtype, zero_point)
    assert got_scale == pytest.approx(scale, rel=1e-12)


def test_values_are_rounded_half_to_even_and_saturated():
    q = quantized_from_int(torch.tensor([300.0, -5.0, 2.5, 3.5]), 0.1, 3)
    assert q.int_repr().tolist() == [255, 0, 2, 4]


def test_no_deprecation_warning_reaches_the_caller():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantized_from_int(torch.arange(4), 0.5, 0)


def test_other_dtypes_are_refused():
    with pytest.raises(ConfigValidationError, match="quint8 or torch.qint8"):
        quantized_from_int(torch.arange(4), 0.5, 0, torch.qint32)
