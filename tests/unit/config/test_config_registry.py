"""Dotted names through the allowlist, and the tagged JSON codecs for values and patterns."""

from __future__ import annotations

import json
import operator
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from config_testkit import FakeObserver, fuse2
from torch import nn

from qplug_core.config import decode_name, encode_name, register_serializable, register_serializable_module
from qplug_core.config.codec import (
    decode_dtype,
    decode_pattern,
    decode_qscheme,
    decode_value,
    encode_dtype,
    encode_pattern,
    encode_qscheme,
    encode_value,
    read_fields,
    unversioned,
)
from qplug_core.errors import ConfigError
from qplug_core.observers.factory import ObserverFactory
from qplug_core.patterns import MatchAllNode


@pytest.mark.parametrize("obj, name", [
    (nn.Conv2d, "torch.nn.modules.conv.Conv2d"),
    (F.relu, "torch.nn.functional.relu"),
    (F.linear, "torch.nn.functional.linear"),   # __module__ is the private torch._C._nn
    (torch.add, "torch.add"),
    (operator.add, "operator.add"),             # __module__ is _operator
    (getattr, "builtins.getattr"),
    (MatchAllNode, "qplug_core.patterns.MatchAllNode"),
    (F.max_pool2d, "torch.nn.functional.max_pool2d"),  # boolean_dispatch wrapper
])
def test_encode_gives_public_allowlisted_name_that_decodes_to_same_object(obj, name):
    assert encode_name(obj) == name
    assert decode_name(name) is obj


def test_torch_nn_short_names_decode():
    assert decode_name("torch.nn.ReLU") is nn.ReLU


@pytest.mark.parametrize("name", [
    "os.system", "subprocess.run", "builtins.eval", "builtins.exec", "torch.nn.modules.conv.F",
    "torch._C._nn.linear", "torch.nn.functional._in_projection", "qplug_core_evil.x",
    "torch.nn.modules.conv.Conv2d.__init__", "torch.nn", "torch.nn.modules.conv.math",
])
def test_disallowed_names_are_config_errors_with_field(name):
    with pytest.raises(ConfigError) as info:
        decode_name(name, field="configs[0].fuser_method")
    assert info.value.field == "configs[0].fuser_method"
    assert "configs[0].fuser_method" in str(info.value)


def test_decode_never_imports_unknown_modules():
    before = set(sys.modules)
    with pytest.raises(ConfigError):
        decode_name("json.tool.main")
    with pytest.raises(ConfigError):
        decode_name("torch.nn.not_loaded_module.Cls")
    assert set(sys.modules) == before


def test_near_miss_gets_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean 'torch.nn.modules.conv.Conv2d'"):
        decode_name("torch.nn.modules.conv.Conv2D")


def test_lambda_cannot_be_encoded_and_error_names_field_and_fix():
    with pytest.raises(ConfigError, match="register_serializable") as info:
        encode_name(lambda x: x, field="configs[1].fuser_method")
    assert info.value.field == "configs[1].fuser_method"


def test_register_serializable_allows_object_and_rejects_conflicting_name():
    def local_fuser(is_qat, a, b):
        return a

    name = register_serializable(local_fuser, "qplug_tests.registry.local_fuser")
    assert encode_name(local_fuser) == name
    assert decode_name(name) is local_fuser
    assert register_serializable(local_fuser, name) == name  # idempotent
    with pytest.raises(ConfigError, match="already registered"):
        register_serializable(fuse2, name)
    with pytest.raises(ConfigError, match="no importable name"):
        register_serializable(lambda: 0)


def test_register_serializable_module_allows_the_module_classes_defined_under_prefix():
    module = types.ModuleType("qplug_tests_prefix.layers")

    class Scale(nn.Module):
        pass

    def helper():  # functions are never allowed wholesale
        return 0

    Scale.__module__ = helper.__module__ = module.__name__
    Scale.__qualname__ = "Scale"
    module.Scale, module.helper, module.json = Scale, helper, json
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(ConfigError):
            decode_name("qplug_tests_prefix.layers.Scale")
        register_serializable_module("qplug_tests_prefix")
        assert decode_name("qplug_tests_prefix.layers.Scale") is Scale
        for name in ("qplug_tests_prefix.layers.helper", "qplug_tests_prefix.layers.json.dumps"):
            with pytest.raises(ConfigError):
                decode_name(name)
    finally:
        del sys.modules[module.__name__]
    with pytest.raises(ConfigError, match="module name"):
        register_serializable_module(".bad")


def test_missing_module_under_allowed_prefix_is_config_error():
    with pytest.raises(ConfigError, match="unknown or disallowed"):
        decode_name("qplug_core.no_such_module.Thing")


@pytest.mark.parametrize("dtype", [torch.quint8, torch.qint8, torch.qint32, torch.float16, torch.float])
def test_dtype_round_trip(dtype):
    assert decode_dtype(encode_dtype(dtype)) is dtype


def test_bad_dtype_and_qscheme_names():
    with pytest.raises(ConfigError, match="did you mean 'torch.quint8'") as info:
        decode_dtype("torch.qint88".replace("qint88", "quint88"), field="x.weight_dtype")
    assert info.value.field == "x.weight_dtype"
    with pytest.raises(ConfigError):
        decode_dtype("torch.add")
    with pytest.raises(ConfigError):
        decode_dtype(7)
    assert decode_qscheme(encode_qscheme(torch.per_channel_symmetric)) is torch.per_channel_symmetric
    with pytest.raises(ConfigError, match="qscheme"):
        decode_qscheme("torch.per_channel_symetric")


@pytest.mark.parametrize("value", [
    None, True, 3, -2.5, "relu", float("inf"), torch.qint8, torch.per_tensor_affine, (1, 2.0, "a"),
    [1, [2, 3]], {"a": (1, torch.float16)}, FakeObserver, ObserverFactory(FakeObserver, {"x": 1}),
    1 + 2j, Ellipsis, torch.device("cpu"),
])
def test_value_codec_round_trips_through_json(value):
    text = json.dumps(encode_value(value, "kw"), allow_nan=False)
    assert decode_value(json.loads(text), "kw") == value


def test_value_codec_rejects_unserialisable_with_path():
    with pytest.raises(ConfigError, match="kwargs.obs") as info:
        encode_value(object(), "kwargs.obs")
    assert info.value.field == "kwargs.obs"
    with pytest.raises(ConfigError, match="'inf', '-inf' or 'nan'"):
        decode_value({"float": "huge"}, "kw")
    with pytest.raises(ConfigError, match="one-key object"):
        decode_value({"dtype": "torch.qint8", "tuple": []}, "kw")


def test_pattern_codec_distinguishes_methods_functions_and_literals():
    pattern = (nn.ReLU, (operator.add, MatchAllNode, (nn.BatchNorm2d, nn.Conv2d)), "relu", 0, (getattr, "shape"))
    doc = encode_pattern(pattern, "pattern")
    assert doc[2] == {"method": "relu"} and doc[3] == {"literal": 0}
    assert doc[0] == {"op": "torch.nn.modules.activation.ReLU"}
    assert decode_pattern(json.loads(json.dumps(doc)), "pattern") == pattern


def test_pattern_codec_errors_name_the_path():
    with pytest.raises(ConfigError) as info:
        decode_pattern([{"op": "torch.nn.modules.conv.Conv2d"}, {"opp": "x"}], "configs[3].pattern")
    assert info.value.field == "configs[3].pattern[1].opp"
    with pytest.raises(ConfigError, match="method name"):
        decode_pattern({"method": 3}, "p")


def test_read_fields_unknown_and_missing_keys():
    with pytest.raises(ConfigError, match="did you mean 'dtype_configs'") as info:
        read_fields({"dtype_config": []}, "configs[2]", ("dtype_configs", "pattern"))
    assert info.value.field == "configs[2].dtype_config"
    with pytest.raises(ConfigError, match="missing required key 'pattern'"):
        read_fields({}, "c", ("pattern",), required=("pattern",))


@pytest.mark.parametrize("doc, message", [
    ({}, "missing 'schema_version'"),
    ({"schema_version": 2}, "unsupported schema_version 2"),
    ({"schema_version": True}, "unsupported schema_version True"),
    ([], "expected a JSON object"),
])
def test_schema_version_checked(doc, message):
    with pytest.raises(ConfigError, match=message):
        unversioned(doc)
