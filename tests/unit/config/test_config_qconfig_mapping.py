"""QConfigMapping: builders, torch.ao's precedence (checked against torch.ao's own helpers), documents."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from config_testkit import FakeObserver, json_round_trip
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qplug_core.config import QConfig, QConfigMapping
from qplug_core.errors import ConfigError, ConfigValidationError

Q = [QConfig(FakeObserver.with_args(tag=i)) for i in range(8)]


def test_builders_chain_and_store():
    m = (QConfigMapping().set_global(Q[0]).set_object_type(nn.Linear, Q[1]).set_object_type("reshape", None)
         .set_module_name_regex("foo.*", Q[2]).set_module_name("foo.bar", Q[3])
         .set_module_name_object_type_order("foo", F.linear, 1, Q[4]))
    assert m.global_qconfig == Q[0]
    assert m.object_type_qconfigs == {nn.Linear: Q[1], "reshape": None}
    assert m.module_name_regex_qconfigs == {"foo.*": Q[2]}
    assert m.module_name_qconfigs == {"foo.bar": Q[3]}
    assert m.module_name_object_type_order_qconfigs == {("foo", F.linear, 1): Q[4]}


def test_precedence_levels():
    m = QConfigMapping().set_global(Q[0])
    assert m.qconfig_for_module("a.b", nn.Linear) == Q[0]
    m.set_object_type(nn.Linear, Q[1])
    assert m.qconfig_for_module("a.b", nn.Linear) == Q[1]
    m.set_module_name_regex(r"a\..*", Q[2])
    assert m.qconfig_for_module("a.b", nn.Linear) == Q[2]
    m.set_module_name("a", Q[3])                      # parent prefix applies to a.b
    assert m.qconfig_for_module("a.b", nn.Linear) == Q[3]
    m.set_module_name("a.b", None)                    # None = do not quantize, wins at its level
    assert m.qconfig_for_module("a.b", nn.Linear) is None
    m.set_module_name_object_type_order("a", nn.Linear, 0, Q[5])  # the first Linear "a" calls
    assert m.qconfig_for_module("a.b", nn.Linear, 0) == Q[5]
    assert m.qconfig_for_module("a.b", nn.Linear, 1) is None
    assert m.qconfig_for_module("ab", nn.Linear) == Q[1]     # "a" is not a dotted parent of "ab"


def test_regex_first_registered_match_wins_and_reset_keeps_order():
    m = QConfigMapping().set_module_name_regex("foo.*bar.*conv[0-9]+", Q[1]).set_module_name_regex("foo.*", Q[2])
    assert m.qconfig_for_module("foo.bar.conv0", nn.Conv2d) == Q[1]
    assert m.qconfig_for_module("foo.baz.relu", nn.ReLU) == Q[2]
    m.set_module_name_regex("foo.*bar.*conv[0-9]+", Q[3])
    assert list(m.module_name_regex_qconfigs) == ["foo.*bar.*conv[0-9]+", "foo.*"]
    assert m.qconfig_for_module("foo.bar.conv0", nn.Conv2d) == Q[3]


def test_node_kinds_follow_torch_ao():
    m = (QConfigMapping().set_global(Q[0]).set_object_type(torch.add, Q[1]).set_object_type(nn.Sequential, Q[2])
         .set_object_type("reshape", Q[3]).set_module_name_object_type_order("blk", nn.Conv2d, 1, Q[4]))
    # call_function: the enclosing module's type overrides the function's object type
    assert m.qconfig_for_function(torch.add, "blk", nn.Sequential) == Q[2]
    assert m.qconfig_for_function(torch.add, "blk", nn.Module) == Q[1]
    # call_method: the same, with the method name as object type
    assert m.qconfig_for_method("reshape", "blk", nn.Module) == Q[3]
    assert m.qconfig_for_method("reshape", "blk", nn.Sequential) == Q[2]
    # call_module: the call index counts inside the parent module
    assert m.qconfig_for_module("blk.1", nn.Conv2d, 1) == Q[4]
    assert m.qconfig_for_module("blk.1", nn.Conv2d, 0) == Q[0]


@pytest.mark.parametrize("call, field", [
    (lambda m: m.set_global(FakeObserver), "global_qconfig"),
    (lambda m: m.set_object_type(3, Q[0]), "object_type"),
    (lambda m: m.set_object_type("", Q[0]), "object_type"),
    (lambda m: m.set_module_name_regex("foo(", Q[0]), "module_name_regex"),
    (lambda m: m.set_module_name(nn.Linear, Q[0]), "module_name"),
    (lambda m: m.set_module_name("a", "qconfig"), "qconfig"),
    (lambda m: m.set_module_name_object_type_order("a", nn.Linear, -1, Q[0]), "index"),
    (lambda m: m.set_module_name_object_type_order("a", nn.Linear, True, Q[0]), "index"),
])
def test_validation(call, field):
    with pytest.raises(ConfigValidationError) as info:
        call(QConfigMapping())
    assert info.value.field == field


def test_round_trip_and_equality():
    m = (QConfigMapping().set_global(Q[0]).set_object_type(nn.Linear, Q[1]).set_object_type("reshape", None)
         .set_object_type(operator.add, Q[2]).set_object_type(F.relu, Q[6])
         .set_module_name_regex("foo.*", Q[2]).set_module_name("foo.bar", None)
         .set_module_name_object_type_order("foo", F.linear, 1, Q[4]))
    back = json_round_trip(m)
    assert back == m
    assert back.object_type_qconfigs["reshape"] is None
    assert list(back.object_type_qconfigs) == [nn.Linear, "reshape", operator.add, F.relu]
    assert m != QConfigMapping()


@pytest.mark.parametrize("doc, field", [
    ({"schema_version": 1, "object_type": [[{"op": "torch.nn.Linear"}]]}, "object_type[0]"),
    ({"schema_version": 1, "object_type": [[{"op": "os.system"}, None]]}, "object_type[0][0].op"),
    ({"schema_version": 1, "object_type": [[{"literal": 3}, None]]}, "object_type[0]"),
    ({"schema_version": 1, "module_name_regex": [["(", None]]}, "module_name_regex[0]"),
    ({"schema_version": 1, "module_name_object_type_order": [["a", {"method": "add"}, "0", None]]},
     "module_name_object_type_order[0]"),
    ({"schema_version": 1, "globl": None}, "globl"),
    ({"schema_version": 1, "module_name": {"a": None}}, "module_name"),
    ({"schema_version": 1, "module_name": [["a", {"activation": {"class": "x.y"}}]]},
     "module_name[0][1].activation.class"),
])
def test_bad_documents(doc, field):
    with pytest.raises(ConfigError) as info:
        QConfigMapping.from_dict(doc)
    assert info.value.field == field


@pytest.mark.parametrize("doc", [
    {"": None, "object_type": [(nn.Linear, None)]},  # hand-written in torch.ao's format
    {"schema_version": 1, "": None},
])
def test_a_torch_ao_format_dict_is_named_as_such(doc):
    with pytest.raises(ConfigValidationError, match=r"this is torch\.ao's QConfigMapping dict .*set_global"):
        QConfigMapping.from_dict(doc)


# -- torch.ao as the oracle ------------------------------------------------------------------------

PATHS = ["", "a", "a.b", "a.b.c", "ab", "a.bc", "x.a.b"]
TYPES = [nn.Linear, nn.Conv2d, F.linear, "reshape"]
REGEXES = ["a.*", r"a\.b", ".*c$", "x"]


@st.composite
def mappings(draw):
    """The same random mapping built with qplug and with torch.ao (qconfigs as opaque values)."""
    ops = draw(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6), st.sampled_from(PATHS),
                                  st.sampled_from(TYPES), st.sampled_from(REGEXES), st.integers(0, 2)),
                        max_size=10))
    return ops


def _build(ops, mapping):
    for kind, q, path, obj_type, regex, index in ops:
        qconfig = None if q == 6 else Q[q]
        [lambda: mapping.set_global(qconfig), lambda: mapping.set_object_type(obj_type, qconfig),
         lambda: mapping.set_module_name_regex(regex, qconfig), lambda: mapping.set_module_name(path, qconfig),
         lambda: mapping.set_module_name_object_type_order(path, obj_type, index, qconfig)][kind]()
    return mapping


@settings(derandomize=True, max_examples=300, deadline=None)
@given(mappings(), st.sampled_from(PATHS), st.sampled_from(TYPES), st.integers(0, 2),
       st.sampled_from([nn.Sequential, nn.Module]))
def test_resolution_matches_torch_ao_helpers(ops, path, obj_type, index, scope_type):
    ao = pytest.importorskip("torch.ao.quantization.fx.qconfig_mapping_utils")
    ao_mapping = _build(ops, pytest.importorskip("torch.ao.quantization").QConfigMapping())
    ours = _build(ops, QConfigMapping())
    g = ao_mapping.global_qconfig
    adjust = ao._maybe_adjust_qconfig_for_module_type_or_name
    order = ao._maybe_adjust_qconfig_for_module_name_object_type_order
    assert ours.qconfig_for_module(path, obj_type) == adjust(ao_mapping, obj_type, path, g)
    # call_module (as _generate_node_name_to_qconfig): order keyed on the parent path
    parent = path.rpartition(".")[0]
    expected = order(ao_mapping, parent, obj_type, index, adjust(ao_mapping, obj_type, path, g))
    assert ours.qconfig_for_module(path, obj_type, index) == expected
    # call_function
    fq = ao._get_object_type_qconfig(ao_mapping, obj_type, g)
    expected = order(ao_mapping, path, obj_type, index, adjust(ao_mapping, scope_type, path, fq))
    assert ours.qconfig_for_function(obj_type, path, scope_type, index) == expected
    # call_method
    expected = adjust(ao_mapping, scope_type, path, adjust(ao_mapping, obj_type, path, g))
    assert ours.qconfig_for_method(obj_type, path, scope_type) == expected
