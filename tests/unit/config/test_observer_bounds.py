"""Observer settings in config documents stay within documented ranges (issue 27, finding 6).

A 3.6 KB document asking for ``HistogramObserver(bins=2**26)`` made prepare take 9.9 s and 1.8 GB;
``upsample_rate=10**6`` ended in a raw allocator error; ``eps=1e30`` was accepted and gave a useless
model silently. Each is now refused when the document is read, with the field named.
"""

from __future__ import annotations

import copy
import tracemalloc

import pytest

import qplug_core as qp
from qplug_core.errors import ConfigValidationError
from qplug_core.observers.bounds import RANGES

HISTOGRAM = "qplug_core.observers.histogram.HistogramObserver"
MOVING_AVERAGE = "qplug_core.observers.minmax.MovingAverageMinMaxObserver"
MSE = "qplug_core.observers.clipping.MSEObserver"
PERCENTILE = "qplug_core.observers.clipping.PercentileObserver"
LSQ = "qplug_core.observers.learnable.LearnableFakeQuantize"

HOSTILE = {
    "huge histogram": (HISTOGRAM, {"bins": 2**26}, "bins"),
    "huge upsample rate": (HISTOGRAM, {"upsample_rate": 10**6}, "upsample_rate"),
    "histogram sub-bins": (HISTOGRAM, {"bins": 2**16, "upsample_rate": 256}, "upsample_rate"),
    "bins as a bool": (HISTOGRAM, {"bins": True}, "bins"),
    "huge eps": (HISTOGRAM, {"eps": 1e30}, "eps"),
    "infinite eps": (MOVING_AVERAGE, {"eps": float("inf")}, "eps"),
    "denormal eps": (MOVING_AVERAGE, {"eps": 1e-45}, "eps"),
    "vanishing averaging constant": (MOVING_AVERAGE, {"averaging_constant": 1e-300}, "averaging_constant"),
    "MSE candidates": (MSE, {"num_candidates": 10**7}, "num_candidates"),
    "percentile NaN": (PERCENTILE, {"percentile": float("nan")}, "percentile"),
    "fractional quant range": (MOVING_AVERAGE, {"quant_min": -0.5, "quant_max": 255.5}, "quant_min"),
}


def mapping_document(cls: str, kwargs: dict) -> dict:
    document = qp.get_default_qconfig_mapping("reference").to_dict()
    activation = document["global"]["activation"]
    activation["class"] = cls
    activation["kwargs"] = {k: v for k, v in activation["kwargs"].items() if k not in kwargs} | kwargs
    return document


@pytest.mark.parametrize("cls, kwargs, field", list(HOSTILE.values()), ids=list(HOSTILE))
def test_out_of_range_settings_are_refused_naming_the_field(cls, kwargs, field):
    tracemalloc.start()
    try:
        with pytest.raises(ConfigValidationError, match=field) as info:
            qp.QConfigMapping.from_dict(mapping_document(cls, kwargs))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert field in str(info.value)
    assert peak < 32 * 2**20  # refused before the histogram (256 MB at 2**26 bins) is allocated


def test_every_bounded_setting_is_documented():
    security = (qp.__file__.rsplit("/qplug_core/", 1)[0] + "/docs/security.md")
    text = open(security, encoding="utf-8").read()
    for field in RANGES:
        assert f"`{field}`" in text, f"{field} is bounded but docs/security.md does not list its range"


@pytest.mark.parametrize("kwargs", [{"bins": 2048, "upsample_rate": 16}, {"bins": 8192},
                                    {"eps": 2**-12}, {"bins": 2**16, "upsample_rate": 64}])
def test_settings_inside_the_ranges_still_load(kwargs):
    document = mapping_document(HISTOGRAM, kwargs)
    assert qp.QConfigMapping.from_dict(copy.deepcopy(document)).to_dict() == document
