"""DTypeWithConstraints / DTypeConfig: validation on construction, constraint checks, round trips."""

from __future__ import annotations

import pytest
import torch
from config_testkit import json_round_trip
from hypothesis import given, settings
from hypothesis import strategies as st

from qplug_core.config import DTypeConfig, DTypeWithConstraints
from qplug_core.errors import ConfigError, ConfigValidationError

QNNPACK_WEIGHT = DTypeWithConstraints(torch.qint8, quant_min_lower_bound=-127, quant_max_upper_bound=127,
                                      scale_min_lower_bound=2 ** -12)


@pytest.mark.parametrize("kwargs, field, text", [
    ({"dtype": torch.qint8, "quant_min_lower_bound": 5, "quant_max_upper_bound": 3},
     "quant_min_lower_bound", "greater than quant_max_upper_bound"),
    ({"dtype": torch.quint8, "quant_max_upper_bound": 256}, "quant_max_upper_bound", "outside the range"),
    ({"dtype": torch.qint8, "quant_min_lower_bound": 1.5}, "quant_min_lower_bound", "must be an int"),
    ({"dtype": torch.qint8, "quant_min_lower_bound": True}, "quant_min_lower_bound", "must be an int"),
    ({"dtype": torch.float16, "quant_min_lower_bound": 0}, "quant_min_lower_bound", "floating dtype"),
    ({"dtype": torch.quint8, "scale_min_lower_bound": -1e-3}, "scale_min_lower_bound", "positive"),
    ({"dtype": torch.quint8, "scale_max_upper_bound": 0.0}, "scale_max_upper_bound", "positive"),
    ({"dtype": torch.quint8, "scale_min_lower_bound": float("nan")}, "scale_min_lower_bound", "finite"),
    ({"dtype": torch.quint8, "scale_min_lower_bound": 1.0, "scale_max_upper_bound": 0.5},
     "scale_min_lower_bound", "greater than scale_max_upper_bound"),
    ({"dtype": torch.quint8, "scale_exact_match": 1 / 256}, "zero_point_exact_match", "both"),
    ({"dtype": torch.quint8, "scale_exact_match": 1 / 256, "zero_point_exact_match": 300},
     "zero_point_exact_match", "within the range"),
    ({"dtype": torch.complex64}, "dtype", "must be one of"),
    ({"dtype": "quint8"}, "dtype", "must be one of"),
    ({"quant_min_lower_bound": 0}, "dtype", "constraints need the dtype"),
])
def test_invalid_constraints_raise_on_construction(kwargs, field, text):
    with pytest.raises(ConfigValidationError, match=text) as info:
        DTypeWithConstraints(**kwargs)
    assert info.value.field == f"DTypeWithConstraints.{field}"


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.integers(-300, 300), st.integers(-300, 300))
def test_quant_bounds_property(low, high):
    """Valid exactly when both lie in qint8's range and low <= high (reliability B5 #13)."""
    valid = -128 <= low <= 127 and -128 <= high <= 127 and low <= high
    if valid:
        c = DTypeWithConstraints(torch.qint8, quant_min_lower_bound=low, quant_max_upper_bound=high)
        assert (c.quant_min_lower_bound, c.quant_max_upper_bound) == (low, high)
    else:
        with pytest.raises(ConfigValidationError):
            DTypeWithConstraints(torch.qint8, quant_min_lower_bound=low, quant_max_upper_bound=high)


def test_constraints_are_frozen_and_repr_shows_set_fields_only():
    with pytest.raises(AttributeError):
        QNNPACK_WEIGHT.dtype = torch.quint8  # type: ignore[misc]
    assert repr(DTypeWithConstraints(torch.quint8)) == "DTypeWithConstraints(dtype=torch.quint8)"


def test_violations_follow_torch_ao_rules():
    assert QNNPACK_WEIGHT.violations(torch.qint8, -127, 127, eps=2 ** -12) == []
    range_reasons = QNNPACK_WEIGHT.violations(torch.qint8, -128, 127, eps=1.0)
    assert len(range_reasons) == 1 and "(-128, 127)" in range_reasons[0] and "(-127, 127)" in range_reasons[0]
    assert "minimum scale" in QNNPACK_WEIGHT.violations(torch.qint8, -127, 127, eps=1e-7)[0]
    assert "eps" in QNNPACK_WEIGHT.violations(torch.qint8, -127, 127)[0]
    assert "must be set" in QNNPACK_WEIGHT.violations(torch.qint8, None, None, eps=1.0)[0]
    assert "dtype torch.quint8" in QNNPACK_WEIGHT.violations(torch.quint8, 0, 127, eps=1.0)[0]
    assert DTypeWithConstraints().violations(torch.qint8, -128, 127) == []


def test_fixed_qparams_violations():
    sigmoid = DTypeWithConstraints(torch.quint8, scale_exact_match=1 / 256, zero_point_exact_match=0)
    assert sigmoid.violations(torch.quint8, 0, 255, 1 / 256, 0) == []
    assert "fixed-qparams observer" in sigmoid.violations(torch.quint8, 0, 255)[0]
    assert "differ" in sigmoid.violations(torch.quint8, 0, 255, 2 / 256, 128)[0]


def test_dtype_config_normalises_and_exposes_plain_dtypes():
    config = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=QNNPACK_WEIGHT,
                         bias_dtype=torch.float)
    assert config.input_dtype is torch.quint8
    assert config.input_dtype_with_constraints == DTypeWithConstraints(torch.quint8)
    assert config.weight_dtype is torch.qint8
    assert config.weight_dtype_with_constraints is QNNPACK_WEIGHT
    assert config == DTypeConfig(DTypeWithConstraints(torch.quint8), torch.quint8, QNNPACK_WEIGHT, torch.float)
    assert DTypeConfig().input_dtype is None
    with pytest.raises(AttributeError):
        config.bias_dtype = None  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, field", [
    ({"input_dtype": "torch.quint8"}, "DTypeConfig.input_dtype"),
    ({"weight_dtype": torch.complex64}, "DTypeConfig.weight_dtype"),
    ({"bias_dtype": 3}, "DTypeConfig.bias_dtype"),
    ({"is_dynamic": 1}, "DTypeConfig.is_dynamic"),
])
def test_dtype_config_validation(kwargs, field):
    with pytest.raises(ConfigValidationError) as info:
        DTypeConfig(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize("config", [
    DTypeConfig(),
    DTypeConfig(torch.quint8, torch.float, torch.qint8, torch.float, is_dynamic=True),
    DTypeConfig(torch.quint8, torch.quint8, QNNPACK_WEIGHT, torch.float),
    DTypeConfig(output_dtype=DTypeWithConstraints(torch.quint8, scale_exact_match=2 / 256,
                                                  zero_point_exact_match=128)),
])
def test_dtype_config_round_trip(config):
    assert json_round_trip(config) == config


def test_dtype_config_document_errors_carry_paths():
    doc = {"schema_version": 1, "weight_dtype": {"dtype": "torch.qint8", "quant_min_lower_bound": 9,
                                                 "quant_max_upper_bound": 3}}
    with pytest.raises(ConfigValidationError) as info:
        DTypeConfig.from_dict(doc)
    assert info.value.field == "weight_dtype.quant_min_lower_bound"
    with pytest.raises(ConfigError, match="unknown key 'bias_type'.*did you mean 'bias_dtype'"):
        DTypeConfig.from_dict({"schema_version": 1, "bias_type": "torch.float32"})
    with pytest.raises(ConfigError, match="missing required key 'dtype'"):
        DTypeConfig.from_dict({"schema_version": 1, "weight_dtype": {"quant_min_lower_bound": 0}})
    with pytest.raises(ConfigError, match="true, false or null"):
        DTypeConfig.from_dict({"schema_version": 1, "is_dynamic": "yes"})
