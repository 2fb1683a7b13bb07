"""Fuzzing the config layer: malformed patterns and mutated documents only ever raise QplugError.

Derandomized with fixed example counts (2,200 examples in all) so CI runs are reproducible.
"""

from __future__ import annotations

import copy
import json
import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from qplug_core.config import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    ObservationType,
    QConfig,
    QConfigMapping,
    register_serializable,
)
from qplug_core.errors import QplugError
from qplug_core.observers.factory import FactoryMixin
from qplug_core.patterns import MatchAllNode


def fuzz(max_examples: int) -> settings:
    return settings(derandomize=True, deadline=None, database=None, max_examples=max_examples,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class _Obs(nn.Module, FactoryMixin):
    def __init__(self, **kwargs):
        super().__init__()


def _fuse2(is_qat, a, b):
    return a


def _fuse3(is_qat, a, b, c):
    return a


for _obj in (_Obs, _fuse2, _fuse3):
    register_serializable(_obj, f"qplug_tests.fuzz.{_obj.__name__}")


def _local_fuser(is_qat, a, b):  # never registered: cannot be serialised
    return a


LEAVES = st.sampled_from([
    nn.Conv2d, nn.ReLU, nn.BatchNorm2d, nn.Linear, F.relu, F.linear, torch.add, operator.add,
    operator.getitem, getattr, "relu", "shape", "", MatchAllNode, MatchAllNode(), nn.ReLU(), 0, 1, -3, 2.5,
    True, None, [nn.ReLU], [], {}, object(), lambda x: x, _local_fuser, torch.quint8, Ellipsis, 1j, b"x",
    slice(1), int, type,
])
OPS = st.sampled_from([nn.Conv2d, nn.ReLU, nn.BatchNorm2d, F.relu, torch.add, operator.add, "relu", MatchAllNode, 0])
#: half garbage, half (mostly) well-formed, so that registration and round trips are reached too
PATTERNS = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=8) | \
    st.recursive(OPS, lambda inner: st.lists(inner, min_size=1, max_size=3).map(tuple), max_leaves=5)
FUSERS = st.sampled_from([None, _fuse2, _fuse3, _local_fuser, lambda *a: a, lambda: 0, print, "fuse", 3])


def _exercise(config: BackendPatternConfig, fuser) -> None:
    config.set_fuser_method(fuser)
    config.validate()
    backend = BackendConfig("fuzz").set_backend_pattern_config(config)
    backend.set_backend_pattern_config(config, replace=True)
    _ = config.complex_fuser_method, repr(backend)
    doc = json.loads(json.dumps(backend.to_dict(), allow_nan=False))
    assert BackendConfig.from_dict(doc) == backend


@fuzz(600)
@given(PATTERNS, FUSERS, st.booleans())
def test_random_patterns_raise_only_qplug_errors(pattern, fuser, complex_format):
    try:
        config = BackendPatternConfig()
        if complex_format:
            config.set_pattern_complex_format(pattern)
        else:
            config.set_pattern(pattern)
        _exercise(config, fuser)
    except QplugError:
        pass


# -- documents -------------------------------------------------------------------------------------

INT8 = DTypeConfig(torch.quint8, torch.quint8, DTypeWithConstraints(torch.qint8, -127, 127, 2 ** -12), torch.float)
QC = QConfig(_Obs.with_args(dtype=torch.quint8, eps=1e-5),
             _Obs.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, bounds=(-127, 127)))

SEED_DOCUMENTS = [
    (BackendConfig, BackendConfig("seed").set_backend_pattern_configs([
        BackendPatternConfig(nn.Linear).add_dtype_config(INT8).set_root_module(nn.Linear),
        BackendPatternConfig((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)).add_dtype_config(INT8).set_fuser_method(_fuse3),
        BackendPatternConfig().set_pattern_complex_format((nn.ReLU, (operator.add, MatchAllNode, nn.Conv2d)))
        .set_fuser_method(_fuse2).set_num_tensor_args_to_observation_type(
            {1: ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT}).set_input_type_to_index({"weight": 1}),
        BackendPatternConfig().set_pattern_complex_format((operator.getitem, (getattr, "shape"), 0)),
    ]).to_dict()),
    (QConfigMapping, QConfigMapping().set_global(QC).set_object_type(nn.Linear, None).set_object_type("add", QC)
     .set_module_name_regex("a.*", QC).set_module_name("a.b", None)
     .set_module_name_object_type_order("a", F.linear, 0, QC).to_dict()),
    (QConfig, QC.to_dict()),
    (DTypeConfig, INT8.to_dict()),
    (BackendPatternConfig, BackendPatternConfig((nn.Conv2d, nn.ReLU)).set_fuser_method(_fuse2).to_dict()),
]

KEYS = ["schema_version", "name", "configs", "pattern", "pattern_complex_format", "observation_type",
        "dtype_configs", "weight_dtype", "dtype", "quant_min_lower_bound", "op", "method", "literal", "class",
        "kwargs", "tuple", "float", "factory", "object", "global", "object_type", "fuser_method", "x"]
ATOMS = (st.none() | st.booleans() | st.integers(-300, 300) | st.floats(allow_nan=False, allow_infinity=False)
         | st.text(max_size=4) | st.sampled_from([
             "torch.quint8", "torch.nn.Linear", "os.system", "builtins.exec", "json.loads", "inf",
             "OUTPUT_SHARE_OBSERVER_WITH_INPUT", "qplug_tests.fuzz._fuse2", "qplug_core.patterns.MatchAllNode",
             "torch.per_channel_symmetric", "qplug_core.nope.X", "torch.nn.functional"]))
JSON = st.recursive(ATOMS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(KEYS), c, max_size=3),
                    max_leaves=6)


def _locations(doc, out):
    """Every (container, key) pair in a JSON tree."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        out.append((doc, key))
        _locations(value, out)
    return out


def _mutate(data, doc):
    for _ in range(data.draw(st.integers(1, 3))):
        places = _locations(doc, [])
        if not places or data.draw(st.integers(0, 20)) == 0:
            return data.draw(JSON)
        container, key = data.draw(st.sampled_from(places))
        action = data.draw(st.sampled_from(["drop", "replace", "replace", "add", "wrap"]))
        if action == "drop":
            del container[key]
        elif action == "replace":
            container[key] = data.draw(JSON)
        elif action == "wrap":
            container[key] = [container[key]]
        elif isinstance(container, dict):
            container[data.draw(st.sampled_from(KEYS))] = data.draw(JSON)
        else:
            container.append(data.draw(JSON))
    return doc


@fuzz(1600)
@given(st.data())
def test_mutated_documents_raise_only_qplug_errors(data):
    cls, seed = data.draw(st.sampled_from(SEED_DOCUMENTS))
    doc = _mutate(data, copy.deepcopy(seed))
    try:
        obj = cls.from_dict(doc)
    except QplugError:
        return
    # whatever loads is a valid object that saves again to an equivalent document
    assert cls.from_dict(json.loads(json.dumps(obj.to_dict()))) == obj


@pytest.mark.parametrize("cls, seed", SEED_DOCUMENTS)
def test_seed_documents_load(cls, seed):
    assert cls.from_dict(seed).to_dict() == seed
