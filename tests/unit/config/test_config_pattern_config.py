"""BackendPatternConfig: builders, pattern formats, fuser arity and wrapping, documents."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from config_testkit import fuse2, fuse3, fuse_varargs, json_round_trip, root_getter
from torch import nn

from qplug_core.config import BackendPatternConfig, DTypeConfig, ObservationType
from qplug_core.errors import ConfigError, ConfigValidationError, PatternError
from qplug_core.patterns import MatchAllNode

INT8 = DTypeConfig(torch.quint8, torch.quint8, torch.qint8, torch.float)


def test_builder_methods_return_self_and_store():
    c = BackendPatternConfig()
    with pytest.warns(UserWarning, match=r"set_reference_quantized_module\(torch\.nn\.modules\.conv\.Conv2d\) "
                                         "has no effect: qplug's convert builds one generic reference form"):
        same = (c.set_pattern((nn.Conv2d, nn.ReLU)).set_observation_type(ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT)
                .add_dtype_config(INT8).set_root_module(nn.Conv2d).set_qat_module(nn.Conv2d)
                .set_reference_quantized_module(nn.Conv2d).set_fused_module(nn.Sequential).set_fuser_method(fuse2)
                .set_root_node_getter(root_getter).set_extra_inputs_getter(root_getter)
                .set_num_tensor_args_to_observation_type({1: ObservationType.INPUT_OUTPUT_NOT_OBSERVED})
                .set_input_type_to_index({"weight": 1}))
    assert same is c
    assert c.pattern == (nn.Conv2d, nn.ReLU) and c.pattern_complex_format == (nn.ReLU, nn.Conv2d)
    assert c.observation_type is ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
    assert c.dtype_configs == [INT8]
    assert (c.root_module, c.qat_module, c.reference_quantized_module, c.fused_module) == \
        (nn.Conv2d, nn.Conv2d, nn.Conv2d, nn.Sequential)
    assert c.fuser_method is fuse2 and c.root_node_getter is root_getter and c.extra_inputs_getter is root_getter
    assert c.num_tensor_args_to_observation_type == {1: ObservationType.INPUT_OUTPUT_NOT_OBSERVED}
    assert c.input_type_to_index == {"weight": 1}


def test_a_torch_ao_qat_module_is_refused_naming_qplugs():
    ao_qat = pytest.importorskip("torch.ao.nn.intrinsic.qat")
    with pytest.raises(ConfigValidationError, match=r"qat_module is torch\.ao's torch\.ao\.nn\.intrinsic\.qat\..*"
                                                    r"LinearReLU.*use qplug_core\.nn\.qat\.LinearReLU") as info:
        BackendPatternConfig(nn.Linear).set_qat_module(ao_qat.LinearReLU)
    assert info.value.field == "qat_module"


def test_defaults_and_set_dtype_configs_replaces():
    c = BackendPatternConfig(nn.Linear)
    assert c.observation_type is ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    assert c.dtype_configs == [] and c.fuser_method is None and c.complex_fuser_method is None
    c.add_dtype_config(INT8).set_dtype_configs([DTypeConfig(torch.float16)])
    assert c.dtype_configs == [DTypeConfig(torch.float16)]
    c.dtype_configs.append(INT8)  # a copy: cannot bypass validation
    assert len(c.dtype_configs) == 1


def test_torch_ao_underscore_aliases():
    c = (BackendPatternConfig()._set_pattern_complex_format((nn.ReLU, (nn.BatchNorm2d, nn.Conv2d)))
         ._set_root_node_getter(root_getter)._set_extra_inputs_getter(root_getter)
         ._set_num_tensor_args_to_observation_type({0: ObservationType.INPUT_OUTPUT_NOT_OBSERVED})
         ._set_input_type_to_index({"bias": 2}))
    assert c.pattern is None and c.pattern_complex_format == (nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))
    assert c.root_node_getter is root_getter and c.input_type_to_index == {"bias": 2}


@pytest.mark.parametrize("pattern", [(nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.ReLU), [nn.Conv2d, nn.ReLU],
                                     nn.ReLU(), (nn.Conv2d, MatchAllNode), ((nn.Conv2d, nn.ReLU), nn.ReLU), 3])
def test_bad_simple_patterns(pattern):
    with pytest.raises(PatternError):
        BackendPatternConfig(pattern)


def test_both_pattern_formats_is_an_error():
    with pytest.raises(ConfigValidationError, match="only one") as info:
        BackendPatternConfig(nn.Linear).set_pattern_complex_format((nn.ReLU, nn.Linear))
    assert info.value.field == "pattern_complex_format"
    with pytest.raises(ConfigValidationError, match="only one") as info:
        BackendPatternConfig().set_pattern_complex_format((nn.ReLU, nn.Linear)).set_pattern(nn.Linear)
    assert info.value.field == "pattern"


def test_simple_fuser_is_wrapped_into_complex_order():
    two = BackendPatternConfig((nn.Conv2d, nn.ReLU)).set_fuser_method(fuse2)
    assert two.complex_fuser_method(True, "relu", "conv") == ("fused", True, "conv", "relu")
    three = BackendPatternConfig((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)).set_fuser_method(fuse3)
    assert three.complex_fuser_method(False, "relu", ("bn", "conv")) == ("fused", False, "conv", "bn", "relu")


def test_complex_fuser_is_used_as_is():
    c = BackendPatternConfig().set_pattern_complex_format((nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))).set_fuser_method(fuse2)
    assert c.complex_fuser_method is fuse2
    assert c.complex_fuser_method(True, "relu", ("bn", "conv")) == ("fused", True, "relu", ("bn", "conv"))


def test_fuser_wrapping_matches_torch_ao():
    ao = pytest.importorskip("torch.ao.quantization.fuser_method_mappings")
    for pattern, fuser, args in [((nn.Conv2d, nn.ReLU), fuse2, ("r", "c")),
                                 ((nn.Conv2d, nn.BatchNorm2d, nn.ReLU), fuse3, ("r", ("b", "c")))]:
        ours = BackendPatternConfig(pattern).set_fuser_method(fuser).complex_fuser_method
        theirs = (ao._reverse2 if len(pattern) == 2 else ao._reverse3)(fuser)
        assert ours(False, *args) == theirs(False, *args)


@pytest.mark.parametrize("pattern, fuser", [
    ((nn.Conv2d, nn.BatchNorm2d, nn.ReLU), fuse2),  # reliability #16: 3-op pattern, 2-module fuser
    ((nn.Conv2d, nn.ReLU), fuse3),
    ((nn.Conv2d, nn.ReLU), lambda a, b: None),      # forgot is_qat
])
def test_fuser_arity_mismatch_is_pattern_error_either_order(pattern, fuser):
    with pytest.raises(PatternError, match="is_qat"):
        BackendPatternConfig(pattern).set_fuser_method(fuser)
    with pytest.raises(PatternError, match="is_qat"):
        BackendPatternConfig().set_fuser_method(fuser).set_pattern(pattern)


def test_fuser_arity_accepts_varargs_and_defaults_and_complex_top_level_length():
    BackendPatternConfig((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)).set_fuser_method(fuse_varargs)
    BackendPatternConfig((nn.Conv2d, nn.ReLU)).set_fuser_method(lambda is_qat, a, b, c=None: None)
    BackendPatternConfig().set_pattern_complex_format(
        (nn.ReLU, (operator.add, MatchAllNode, nn.Conv2d))).set_fuser_method(fuse2)
    with pytest.raises(PatternError):
        BackendPatternConfig().set_pattern_complex_format(
            (nn.ReLU, (operator.add, MatchAllNode, nn.Conv2d))).set_fuser_method(fuse3)


def test_fuser_on_single_op_pattern_is_pattern_error():
    with pytest.raises(PatternError, match="tuple pattern"):
        BackendPatternConfig(nn.Conv2d).set_fuser_method(fuse2)


@pytest.mark.parametrize("setter, value, field", [
    ("set_observation_type", "OUTPUT_SHARE_OBSERVER_WITH_INPUT", "observation_type"),
    ("add_dtype_config", {"input_dtype": torch.quint8}, "dtype_config"),
    ("set_dtype_configs", INT8, "dtype_configs"),
    ("set_root_module", nn.Conv2d(1, 1, 1), "root_module"),
    ("set_qat_module", F.relu, "qat_module"),
    ("set_reference_quantized_module", "Conv2d", "reference_quantized_module"),
    ("set_fused_module", int, "fused_module"),
    ("set_fuser_method", "fuse", "fuser_method"),
    ("set_root_node_getter", 3, "root_node_getter"),
    ("set_extra_inputs_getter", 3, "extra_inputs_getter"),
    ("set_num_tensor_args_to_observation_type", {-1: ObservationType.INPUT_OUTPUT_NOT_OBSERVED},
     "num_tensor_args_to_observation_type.-1"),
    ("set_input_type_to_index", {"weight": "1"}, "input_type_to_index.weight"),
])
def test_setter_validation(setter, value, field):
    with pytest.raises(ConfigValidationError) as info:
        getattr(BackendPatternConfig(), setter)(value)
    assert info.value.field == field


def test_observation_type_string_gets_suggestion():
    with pytest.raises(ConfigValidationError, match="did you mean 'OUTPUT_SHARE_OBSERVER_WITH_INPUT'"):
        BackendPatternConfig().set_observation_type("OUTPUT_SHARE_OBSERVER_WITH_INPUTS")


def test_validate_requires_pattern():
    with pytest.raises(ConfigValidationError, match="pattern is not set"):
        BackendPatternConfig().validate()
    c = BackendPatternConfig(nn.Linear)
    assert c.validate() is c


@pytest.mark.parametrize("config", [
    BackendPatternConfig(nn.Linear),
    BackendPatternConfig((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)).add_dtype_config(INT8).set_fuser_method(fuse3)
    .set_fused_module(nn.Sequential).set_root_module(nn.Conv2d).set_qat_module(nn.Conv2d),
    BackendPatternConfig().set_pattern_complex_format((nn.ReLU, (operator.add, MatchAllNode, (nn.BatchNorm2d, nn.Conv2d))))
    .set_fuser_method(fuse2).set_root_node_getter(root_getter).set_extra_inputs_getter(root_getter),
    BackendPatternConfig("reshape").set_observation_type(ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT)
    .set_num_tensor_args_to_observation_type({0: ObservationType.INPUT_OUTPUT_NOT_OBSERVED,
                                              1: ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT})
    .set_input_type_to_index({"weight": 1, "bias": 2}),
    BackendPatternConfig().set_pattern_complex_format((operator.getitem, (getattr, "shape"), 0)),
    BackendPatternConfig((F.linear, F.relu)).set_fuser_method(fuse2),
])
def test_round_trip(config):
    back = json_round_trip(config)
    assert back == config
    assert back.pattern_complex_format == config.pattern_complex_format


def test_repr_shows_non_default_fields_only():
    assert repr(BackendPatternConfig(nn.Linear)) == "BackendPatternConfig(pattern=Linear)"
    text = repr(BackendPatternConfig((nn.Conv2d, nn.ReLU)).set_fuser_method(fuse2))
    assert "fuser_method=fuse2" in text and "observation_type" not in text and "dtype_configs" not in text


@pytest.mark.parametrize("doc, error, field", [
    ({"pattern": {"op": "torch.nn.Linear"}, "pattern_complex_format": {"op": "torch.nn.Linear"}},
     ConfigValidationError, "pattern_complex_format"),
    ({"pattern": [{"op": "torch.nn.Linear"}] * 4}, PatternError, "pattern"),
    ({"pattern": {"op": "torch.nn.Linear"}, "observation_type": "SHARE"}, ConfigError, "observation_type"),
    ({"pattern": {"op": "torch.nn.Linear"}, "dtype_configs": [{"weight_dtype": "torch.qint9"}]},
     ConfigError, "dtype_configs[0].weight_dtype"),
    ({"pattern": {"op": "torch.nn.Linear"}, "root_module": "torch.nn.functional.relu"},
     ConfigValidationError, "root_module"),
    ({"pattern": {"op": "torch.nn.Linear"}, "fuser_method": "qplug_tests.config.fuse2"}, PatternError, "fuser_method"),
    ({"pattern": {"op": "torch.nn.Linear"}, "num_tensor_args_to_observation_type": {"x": "INPUT_OUTPUT_NOT_OBSERVED"}},
     ConfigError, "num_tensor_args_to_observation_type.x"),
    ({"pattern": {"op": "torch.nn.Linear"}, "input_type_to_index": {"w": -1}}, ConfigValidationError,
     "input_type_to_index"),
    ({"pattern": {"op": "torch.nn.Linear"}, "fused_modul": None}, ConfigError, "fused_modul"),
])
def test_bad_documents(doc, error, field):
    with pytest.raises(error) as info:
        BackendPatternConfig.from_dict({"schema_version": 1, **doc})
    assert info.value.field == field
