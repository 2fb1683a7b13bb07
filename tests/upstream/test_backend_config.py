"""Port of PyTorch's ``test/quantization/core/test_backend_config.py`` (TestBackendConfig).

Translation: ``torch.ao.quantization.backend_config.*`` -> ``qp.config.*``;
``nni.LinearReLU`` / ``nnqat.Linear`` -> ``qplug_core.nn.intrinsic.LinearReLU`` /
``qplug_core.nn.qat.Linear``; ``_sequential_wrapper2(nni.LinearReLU)`` -> qplug's
``fuse_linear_relu``; private setters ``_set_root_node_getter`` ... are public in qplug
(``set_root_node_getter`` ...; the underscored names remain as aliases and are used here).

Deliberate difference (docs/migrating.md): qplug's ``to_dict()`` documents are JSON-safe (dtypes
and callables as allowlisted dotted names, a ``schema_version``), so the upstream dicts of Python
objects are translated into the same content in that form, and ``from_dict`` of upstream's
Python-object dicts is refused with a ConfigError. Callables must have an allowlisted name:
upstream's bound method ``self._extra_inputs_getter`` and ``nnqr.Linear`` become module-level
objects registered with ``register_serializable``.
"""

from __future__ import annotations

import json

import pytest
import torch

import qplug_core.nn.intrinsic as nni
import qplug_core.nn.qat as nnqat
from qplug_core.config import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    ObservationType,
    register_serializable,
)
from qplug_core.errors import ConfigError
from qplug_core.nn.fuser_methods import fuse_linear_relu

# upstream sets reference_quantized_module throughout; qplug warns that it is unused (tested in
# tests/unit/config/test_config_pattern_config.py)
pytestmark = pytest.mark.filterwarnings("ignore:BackendPatternConfig.set_reference_quantized_module")


class ReferenceLinear(torch.nn.Linear):
    """Stands for upstream's ``nnqr.Linear`` (torch.ao classes are outside qplug's allowlist)."""


def default_root_node_getter(node_pattern):
    """Upstream's ``_default_root_node_getter``: descend the last element to a node."""
    while not isinstance(node_pattern, torch.fx.Node):
        node_pattern = node_pattern[-1]
    return node_pattern


def extra_inputs_getter(p):
    return (torch.rand(3, 3),)


for _obj in (ReferenceLinear, default_root_node_getter, extra_inputs_getter):
    register_serializable(_obj)

dtype_config1 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8,
                            weight_dtype=torch.qint8, bias_dtype=torch.float)
dtype_config2 = DTypeConfig(input_dtype=torch.float16, output_dtype=torch.float, is_dynamic=True)
activation_dtype_with_constraints = DTypeWithConstraints(
    dtype=torch.quint8, quant_min_lower_bound=0, quant_max_upper_bound=127,
    scale_min_lower_bound=2 ** -12)
weight_dtype_with_constraints = DTypeWithConstraints(
    dtype=torch.qint8, quant_min_lower_bound=-128, quant_max_upper_bound=127,
    scale_min_lower_bound=2 ** -12)
dtype_config3 = DTypeConfig(input_dtype=activation_dtype_with_constraints,
                            output_dtype=activation_dtype_with_constraints,
                            weight_dtype=weight_dtype_with_constraints)

# upstream's dtype_config_dict1 / 2 / 3, in qplug's JSON form
dtype_config_dict1 = {"schema_version": 1, "input_dtype": "torch.quint8", "output_dtype": "torch.quint8",
                      "weight_dtype": "torch.qint8", "bias_dtype": "torch.float32"}
dtype_config_dict2 = {"schema_version": 1, "input_dtype": "torch.float16",
                      "output_dtype": "torch.float32", "is_dynamic": True}

_num_tensor_args_to_observation_type = {
    0: ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT,
    1: ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT,
    2: ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT,
}
_input_type_to_index = {"bias": 0, "input": 1, "weight": 2}


def _get_backend_op_config1():
    return BackendPatternConfig((torch.nn.Linear, torch.nn.ReLU)) \
        .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT) \
        .add_dtype_config(dtype_config1) \
        .add_dtype_config(dtype_config2) \
        .set_root_module(torch.nn.Linear) \
        .set_qat_module(nnqat.Linear) \
        .set_reference_quantized_module(ReferenceLinear) \
        .set_fused_module(nni.LinearReLU) \
        .set_fuser_method(fuse_linear_relu)


def _get_backend_op_config2():
    return BackendPatternConfig(torch.add) \
        .add_dtype_config(dtype_config2) \
        ._set_root_node_getter(default_root_node_getter) \
        ._set_extra_inputs_getter(extra_inputs_getter) \
        ._set_num_tensor_args_to_observation_type(_num_tensor_args_to_observation_type) \
        ._set_input_type_to_index(_input_type_to_index)


# -- DTypeConfig -------------------------------------------------------------------------------


def test_dtype_config_from_dict():
    assert DTypeConfig.from_dict(dtype_config_dict1) == dtype_config1
    assert DTypeConfig.from_dict(dtype_config_dict2) == dtype_config2
    assert DTypeConfig.from_dict(dtype_config3.to_dict()) == dtype_config3
    # upstream's legacy dict of Python objects: refused, with the reason
    with pytest.raises(ConfigError, match="schema_version"):
        DTypeConfig.from_dict({"input_dtype": torch.quint8, "output_dtype": torch.quint8})


def test_dtype_config_to_dict():
    assert dtype_config1.to_dict() == dtype_config_dict1
    assert dtype_config2.to_dict() == dtype_config_dict2
    doc = dtype_config3.to_dict()
    json.dumps(doc)  # plain JSON
    assert DTypeConfig.from_dict(doc) == dtype_config3


# -- BackendPatternConfig ------------------------------------------------------------------------


def test_backend_op_config_set_observation_type():
    conf = BackendPatternConfig(torch.nn.Linear)
    assert conf.observation_type == ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    conf.set_observation_type(ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT)
    assert conf.observation_type == ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT


def test_backend_op_config_add_dtype_config():
    conf = BackendPatternConfig(torch.nn.Linear)
    assert len(conf.dtype_configs) == 0
    conf.add_dtype_config(dtype_config1)
    conf.add_dtype_config(dtype_config2)
    assert len(conf.dtype_configs) == 2
    assert conf.dtype_configs[0] == dtype_config1
    assert conf.dtype_configs[1] == dtype_config2


def test_backend_op_config_set_root_module():
    conf = BackendPatternConfig(nni.LinearReLU)
    assert conf.root_module is None
    conf.set_root_module(torch.nn.Linear)
    assert conf.root_module == torch.nn.Linear


def test_backend_op_config_set_qat_module():
    conf = BackendPatternConfig(torch.nn.Linear)
    assert conf.qat_module is None
    conf.set_qat_module(nnqat.Linear)
    assert conf.qat_module == nnqat.Linear


def test_backend_op_config_set_reference_quantized_module():
    conf = BackendPatternConfig(torch.nn.Linear)
    assert conf.reference_quantized_module is None
    conf.set_reference_quantized_module(ReferenceLinear)
    assert conf.reference_quantized_module == ReferenceLinear


def test_backend_op_config_set_fused_module():
    conf = BackendPatternConfig((torch.nn.Linear, torch.nn.ReLU))
    assert conf.fused_module is None
    conf.set_fused_module(nni.LinearReLU)
    assert conf.fused_module == nni.LinearReLU


def test_backend_op_config_set_fuser_method():
    conf = BackendPatternConfig((torch.nn.Linear, torch.nn.ReLU))
    assert conf.fuser_method is None
    conf.set_fuser_method(fuse_linear_relu)
    assert conf.fuser_method == fuse_linear_relu


def test_backend_op_config_set_root_node_getter():
    conf = BackendPatternConfig((torch.nn.Linear, torch.nn.ReLU))
    assert conf._root_node_getter is None
    conf._set_root_node_getter(default_root_node_getter)
    assert conf._root_node_getter == default_root_node_getter


def test_backend_op_config_set_extra_inputs_getter():
    conf = BackendPatternConfig(torch.nn.Linear)
    assert conf._extra_inputs_getter is None
    conf._set_extra_inputs_getter(extra_inputs_getter)
    assert conf._extra_inputs_getter == extra_inputs_getter


def test_backend_op_config_set_num_tensor_args_to_observation_type():
    conf = BackendPatternConfig(torch.add)
    assert len(conf._num_tensor_args_to_observation_type) == 0
    conf._set_num_tensor_args_to_observation_type(_num_tensor_args_to_observation_type)
    assert conf._num_tensor_args_to_observation_type == _num_tensor_args_to_observation_type


def test_backend_op_config_set_input_type_to_index():
    conf = BackendPatternConfig(torch.addmm)
    assert len(conf._input_type_to_index) == 0
    conf._set_input_type_to_index(_input_type_to_index)
    assert conf._input_type_to_index == _input_type_to_index


def test_backend_op_config_from_dict():
    conf1 = BackendPatternConfig.from_dict(_get_backend_op_config1().to_dict())
    assert conf1.pattern == (torch.nn.Linear, torch.nn.ReLU)
    assert conf1.observation_type == ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    assert conf1.root_module == torch.nn.Linear
    assert conf1.qat_module == nnqat.Linear
    assert conf1.reference_quantized_module == ReferenceLinear
    assert conf1.fused_module == nni.LinearReLU
    assert conf1.fuser_method == fuse_linear_relu
    assert conf1._root_node_getter is None
    assert conf1._extra_inputs_getter is None
    assert len(conf1._num_tensor_args_to_observation_type) == 0
    assert len(conf1._input_type_to_index) == 0
    # temporary/internal keys
    conf2 = BackendPatternConfig.from_dict(_get_backend_op_config2().to_dict())
    assert conf2.pattern == torch.add
    assert conf2.observation_type == ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
    assert conf2.root_module is None and conf2.qat_module is None
    assert conf2.reference_quantized_module is None and conf2.fused_module is None
    assert conf2.fuser_method is None
    assert conf2._root_node_getter == default_root_node_getter
    assert conf2._extra_inputs_getter == extra_inputs_getter
    assert conf2._num_tensor_args_to_observation_type == _num_tensor_args_to_observation_type
    assert conf2._input_type_to_index == _input_type_to_index


def test_backend_op_config_to_dict():
    conf_dict1 = _get_backend_op_config1().to_dict()
    conf_dict2 = _get_backend_op_config2().to_dict()
    json.dumps([conf_dict1, conf_dict2])
    # upstream compares to hand-written dicts of the same fields; here, field by field
    assert conf_dict1["observation_type"] == "OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT"
    assert [d["input_dtype"] for d in conf_dict1["dtype_configs"]] == ["torch.quint8", "torch.float16"]
    assert conf_dict1["fuser_method"].endswith("fuse_linear_relu")
    assert conf_dict1["qat_module"].endswith("Linear") and conf_dict1["fused_module"].endswith("LinearReLU")
    assert conf_dict2["root_node_getter"].endswith("default_root_node_getter")
    assert conf_dict2["extra_inputs_getter"].endswith("extra_inputs_getter")
    assert BackendPatternConfig.from_dict(conf_dict1) == _get_backend_op_config1()
    assert BackendPatternConfig.from_dict(conf_dict2) == _get_backend_op_config2()


# -- BackendConfig -------------------------------------------------------------------------------


def test_backend_config_set_name():
    conf = BackendConfig("name1")
    assert conf.name == "name1"
    conf.set_name("name2")
    assert conf.name == "name2"


def test_backend_config_set_backend_pattern_config():
    conf = BackendConfig("name1")
    assert len(conf.configs) == 0
    backend_op_config1 = _get_backend_op_config1()
    backend_op_config2 = _get_backend_op_config2()
    conf.set_backend_pattern_config(backend_op_config1)
    # upstream reads the private _pattern_complex_format_to_config; qplug's is pattern_to_config()
    assert conf.pattern_to_config() == {(torch.nn.ReLU, torch.nn.Linear): backend_op_config1}
    conf.set_backend_pattern_config(backend_op_config2)
    assert conf.pattern_to_config() == {
        (torch.nn.ReLU, torch.nn.Linear): backend_op_config1,
        torch.add: backend_op_config2,
    }


def test_backend_config_from_dict():
    op_dict1 = _get_backend_op_config1().to_dict()
    op_dict2 = _get_backend_op_config2().to_dict()
    conf_dict = {"schema_version": 1, "name": "name1",
                 "configs": [{k: v for k, v in d.items() if k != "schema_version"}
                             for d in (op_dict1, op_dict2)]}
    conf = BackendConfig.from_dict(conf_dict)
    assert conf.name == "name1"
    assert len(conf.configs) == 2
    key1 = (torch.nn.ReLU, torch.nn.Linear)
    key2 = torch.add
    table = conf.pattern_to_config()
    assert key1 in table and key2 in table
    assert table[key1].to_dict() == op_dict1
    assert table[key2].to_dict() == op_dict2


def test_backend_config_to_dict():
    op1, op2 = _get_backend_op_config1(), _get_backend_op_config2()
    conf = BackendConfig("name1").set_backend_pattern_config(op1).set_backend_pattern_config(op2)
    conf_dict = {"schema_version": 1, "name": "name1",
                 "configs": [{k: v for k, v in d.items() if k != "schema_version"}
                             for d in (op1.to_dict(), op2.to_dict())]}
    assert conf.to_dict() == conf_dict
