"""Defects an accuracy-tuning user found (2026-12-06): each test is that user's own call, with the
numbers or the error they rely on."""

from __future__ import annotations

import math

import pytest

import qplug_core as qp
from qplug_core.errors import ConfigValidationError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


@pytest.mark.parametrize("kwargs,field,shown", [
    ({"sqnr": math.nan}, "sqnr", "nan"), ({"sqnr": math.inf}, "sqnr", "inf"),
    ({"metric": lambda reference, quantized: 0.0, "minimum": math.nan}, "minimum", "nan"),
    ({"cosine": "0.99"}, "cosine", "'0.99'"), ({"cosine": 0.99, "neighbours": True}, "neighbours", "True")])
def test_target_thresholds_must_be_finite_numbers(kwargs, field, shown):
    """NaN and inf ran the whole search to "sqnr 56.08 < nan"; a string raised a raw TypeError."""
    with pytest.raises(ConfigValidationError, match=rf"Target\.{field} must be a finite number, got {shown}$"):
        qp.Target(**kwargs)
