"""BackendConfig: registration order, duplicates, validation and versioned documents."""

from __future__ import annotations

import json
import operator

import pytest
import torch
import torch.nn.functional as F
from config_testkit import fuse2, fuse3, json_round_trip
from torch import nn

from qplug_core.config import BackendConfig, BackendPatternConfig, DTypeConfig, DTypeWithConstraints
from qplug_core.errors import ConfigError, ConfigValidationError, DuplicatePatternError, PatternError
from qplug_core.patterns import MatchAllNode

INT8 = DTypeConfig(torch.quint8, torch.quint8, DTypeWithConstraints(torch.qint8, -127, 127, 2 ** -12), torch.float)


def sample() -> BackendConfig:
    return BackendConfig("toy").set_backend_pattern_configs([
        BackendPatternConfig(nn.Linear).add_dtype_config(INT8),
        BackendPatternConfig((nn.Conv2d, nn.ReLU)).add_dtype_config(INT8).set_fuser_method(fuse2),
        BackendPatternConfig((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)).set_fuser_method(fuse3),
        BackendPatternConfig().set_pattern_complex_format((nn.ReLU, (operator.add, MatchAllNode, nn.Conv2d))),
        BackendPatternConfig(F.relu),
    ])


def test_configs_and_pattern_to_config_keep_insertion_order():
    backend = sample()
    assert backend.name == "toy"
    assert [c.pattern_complex_format for c in backend.configs] == list(backend.pattern_to_config())
    assert list(backend.pattern_to_config())[:3] == [nn.Linear, (nn.ReLU, nn.Conv2d),
                                                     (nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))]
    backend.configs.clear()  # a copy
    assert len(backend.configs) == 5
    assert BackendConfig().set_name("x").name == "x"


def test_duplicate_pattern_in_either_format_is_rejected_with_its_name():
    backend = sample()
    with pytest.raises(DuplicatePatternError, match=r"ReLU <- Conv2d.*configs\[1\].*replace=True") as info:
        backend.set_backend_pattern_config(BackendPatternConfig().set_pattern_complex_format((nn.ReLU, nn.Conv2d)))
    assert info.value.field == "configs[1]"
    assert len(backend.configs) == 5


def test_replace_true_overrides_in_place():
    backend = sample()
    new = BackendPatternConfig((nn.Conv2d, nn.ReLU)).set_fuser_method(fuse2)
    backend.set_backend_pattern_config(new, replace=True)
    assert backend.configs[1] is new and len(backend.configs) == 5
    backend.set_backend_pattern_configs([BackendPatternConfig(nn.Linear)], replace=True)
    assert backend.configs[0].dtype_configs == []


def test_registration_validates_configs():
    with pytest.raises(ConfigValidationError, match="pattern is not set"):
        BackendConfig().set_backend_pattern_config(BackendPatternConfig())
    with pytest.raises(ConfigValidationError, match="BackendPatternConfig") as info:
        BackendConfig().set_backend_pattern_config((nn.Conv2d, nn.ReLU))
    assert info.value.field == "configs[0]"
    with pytest.raises(ConfigError):
        BackendConfig().set_backend_pattern_configs(BackendPatternConfig(nn.Linear))
    with pytest.raises(ConfigValidationError):
        BackendConfig(name=3)


def test_validate_catches_patterns_edited_after_registration():
    backend = sample()
    assert backend.validate() is backend
    backend.configs[0]._pattern = (nn.Conv2d, nn.ReLU)  # bypassing the builders
    with pytest.raises(DuplicatePatternError, match="configs"):
        backend.validate()


def test_round_trip_through_json():
    backend = sample()
    doc = json.loads(json.dumps(backend.to_dict(), allow_nan=False))
    assert doc["schema_version"] == 1
    assert BackendConfig.from_dict(doc) == backend
    assert json_round_trip(BackendConfig()) == BackendConfig()


def test_repr_non_default_only():
    assert repr(BackendConfig()) == "BackendConfig()"
    assert repr(BackendConfig("x")) == "BackendConfig(name='x')"
    assert "ReLU <- operator.add(*, Conv2d)" in repr(sample())


def _mutated(path, value):
    doc = sample().to_dict()
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


@pytest.mark.parametrize("path, value, error, field", [
    (("schema_version",), 99, ConfigError, "schema_version"),
    (("configs", 3, "dtype_configs"), [{"weight_dtype": 5}], ConfigError, "configs[3].dtype_configs[0].weight_dtype"),
    (("configs", 1, "dtype_configs", 0, "weight_dtype", "quant_min_lower_bound"), 200,
     ConfigValidationError, "configs[1].dtype_configs[0].weight_dtype.quant_min_lower_bound"),
    (("configs", 2, "fuser_method"), "builtins.exec", ConfigError, "configs[2].fuser_method"),
    (("configs", 0, "patern"), None, ConfigError, "configs[0].patern"),
    (("configs", 4, "pattern"), [{"op": "torch.nn.Conv2d"}, {"op": "torch.nn.ReLU"}], DuplicatePatternError,
     "configs[4]"),
    (("configs",), {"a": 1}, ConfigError, "configs"),
    (("name",), ["toy"], ConfigError, "name"),
])
def test_bad_documents_report_the_key_path(path, value, error, field):
    with pytest.raises(error) as info:
        BackendConfig.from_dict(_mutated(path, value))
    assert info.value.field == field


def test_config_without_pattern_in_document():
    doc = sample().to_dict()
    del doc["configs"][0]["pattern"]
    with pytest.raises(ConfigValidationError, match=r"configs\[0\]: has no 'pattern'"):
        BackendConfig.from_dict(doc)


def test_unhashable_pattern_literal_is_pattern_error():
    config = BackendPatternConfig().set_pattern_complex_format((operator.getitem, MatchAllNode, 0))
    config._pattern_complex = (operator.getitem, MatchAllNode, slice(0, 1))  # slices are not hashable on 3.11
    with pytest.raises(PatternError):
        BackendConfig().set_backend_pattern_config(config)
