"""Tests of the pattern format: validation, simple <-> complex conversion, ordering and printing."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qplug_core.errors import ConfigError, PatternError
from qplug_core.patterns import (
    MatchAllNode,
    format_pattern,
    pattern_size,
    sort_patterns,
    to_complex_format,
    to_simple_format,
    validate_pattern,
)

RESNET_TAIL = (nn.ReLU, (operator.add, MatchAllNode, (nn.BatchNorm2d, nn.Conv2d)))
OPS = [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Linear, F.relu, torch.relu, operator.add, "relu"]


# -- conversion ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("simple", "complex_"), [
    (nn.ReLU, nn.ReLU),
    ("relu", "relu"),
    ((nn.Conv2d, nn.ReLU), (nn.ReLU, nn.Conv2d)),
    ((nn.Conv2d, nn.BatchNorm2d, nn.ReLU), (nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))),
    ((nn.Linear, F.relu), (F.relu, nn.Linear)),
    ((torch.add, "relu"), ("relu", torch.add)),
])
def test_to_complex_format_and_back(simple, complex_):
    assert to_complex_format(simple) == complex_
    assert to_simple_format(complex_) == simple


@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(OPS), min_size=1, max_size=3))
def test_round_trip_simple_complex_simple(ops):
    simple = ops[0] if len(ops) == 1 else tuple(ops)
    assert to_simple_format(to_complex_format(simple)) == simple


@pytest.mark.parametrize("simple", [(nn.ReLU,), (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.ReLU), ()])
def test_to_complex_format_rejects_other_tuple_lengths(simple):
    with pytest.raises(PatternError, match=r"Expected a tuple with 2 or 3 elements, got: ") as info:
        to_complex_format(simple)
    assert info.value.position == ()
    assert info.value.pattern == simple


@pytest.mark.parametrize(("simple", "position", "message"), [
    ((nn.Conv2d, MatchAllNode), (1,), "MatchAllNode has no meaning in the simple format"),
    ((nn.Conv2d, (nn.BatchNorm2d, nn.ReLU)), (1,), "single operators only"),
    ((nn.Conv2d, 3), (1,), "literal 3 cannot be an anchor"),
    ((nn.Conv2d, nn.ReLU()), (1,), r"write ReLU, not ReLU\(\)"),
    ([nn.Conv2d, nn.ReLU], (), r"write the simple pattern as a tuple \(Conv2d, ReLU\)"),
])
def test_simple_format_element_errors(simple, position, message):
    with pytest.raises(PatternError, match=message) as info:
        validate_pattern(simple, format="simple")
    assert info.value.position == position


@pytest.mark.parametrize(("complex_", "position", "message"), [
    ((nn.ReLU, nn.Conv2d, nn.Conv2d), (), "2 argument sub-patterns"),
    ((operator.add, MatchAllNode, nn.Conv2d), (), "2 argument sub-patterns"),
    ((nn.ReLU, MatchAllNode), (1,), "MatchAllNode only exists in the complex format"),
    (("size", 0), (1,), "literal 0 only exists in the complex format"),
    ((getattr, "shape"), (), "getattr patterns have no simple form"),
    ((nn.ReLU, (getattr, "shape")), (1,), "getattr patterns have no simple form"),
    ((nn.ReLU,), (), "a 1-tuple has no simple form"),
    ((nn.ReLU, (nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))), (), "chain of 4 operators"),
])
def test_to_simple_format_explains_why_there_is_none(complex_, position, message):
    with pytest.raises(PatternError, match=message) as info:
        to_simple_format(complex_)
    assert info.value.position == position


# -- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", [
    RESNET_TAIL,
    (nn.ReLU, (operator.add, (nn.BatchNorm2d, nn.Conv2d), MatchAllNode)),
    (operator.getitem, (getattr, "shape"), 0),
    (torch.ops.aten.relu.default, MatchAllNode),
    (operator.getitem, torch.ops.aten.max_pool2d_with_indices.default, 0),
    ("relu", MatchAllNode),
    ("view", MatchAllNode, -1),
    (torch.flatten, MatchAllNode, 1, -1.0, None, torch.float32),
    (F.relu,),
    F.relu,
])
def test_valid_complex_patterns(pattern):
    assert validate_pattern(pattern) is None


@pytest.mark.parametrize(("pattern", "position", "message"), [
    ((), (), "Empty tuple"),
    ((nn.ReLU, ()), (1,), "Empty tuple"),
    ([nn.ReLU, nn.Conv2d], (), r"write \(ReLU, Conv2d\)"),
    ((nn.ReLU, [nn.BatchNorm2d, nn.Conv2d]), (1,), "patterns use tuples"),
    ((operator.add, MatchAllNode(), nn.Conv2d), (1,), "use the class itself"),
    ((nn.ReLU(), nn.Conv2d), (0,), "patterns use module classes"),
    ((nn.ReLU, (nn.BatchNorm2d, nn.Conv2d(1, 1, 1))), (1, 1), "patterns use module classes"),
    ((3, nn.Conv2d), (0,), "literal 3 cannot be an anchor"),
    (None, (), "literal None cannot be an anchor"),
    (((nn.ReLU,), nn.Conv2d), (0,), "anchor .* must be a single operator"),
    ((nn.ReLU, (getattr,)), (1,), "exactly one attribute name"),
    ((getattr, "shape", "dtype"), (), "exactly one attribute name"),
    ((getattr, 3), (), "exactly one attribute name"),
    ((operator.getitem, getattr, 0), (1,), "bare getattr"),
    (getattr, (), "bare getattr"),
    ((MatchAllNode, nn.Conv2d), (0,), "takes no sub-patterns"),
    (MatchAllNode, (), "would match every node"),
    ((nn.ReLU, object()), (1,), "Unsupported pattern element"),
    ((nn.ReLU, {nn.Conv2d}), (1,), "Unsupported pattern element"),
])
def test_validate_pattern_errors(pattern, position, message):
    with pytest.raises(PatternError, match=message) as info:
        validate_pattern(pattern)
    error = info.value
    assert error.position == position
    assert error.pattern is pattern
    assert isinstance(error, ConfigError) and error.field == "pattern"


def test_validate_error_message_names_position_and_pattern():
    with pytest.raises(PatternError) as info:
        validate_pattern((operator.add, MatchAllNode, (nn.BatchNorm2d, nn.ReLU())))
    assert str(info.value) == (
        "Got a module instance ReLU(); patterns use module classes: write ReLU, not ReLU() "
        "at position (2, 1) in pattern (operator.add, MatchAllNode, (BatchNorm2d, ReLU()))")


def test_validate_pattern_rejects_unknown_format():
    with pytest.raises(PatternError, match="Unknown pattern format 'reversed'"):
        validate_pattern(nn.ReLU, format="reversed")  # type: ignore[arg-type]


def test_four_op_tuple_is_valid_complex_but_not_simple():
    pattern = (nn.ReLU, nn.ReLU, nn.ReLU, nn.ReLU)
    validate_pattern(pattern)
    with pytest.raises(PatternError, match="2 or 3 elements"):
        validate_pattern(pattern, format="simple")


# -- ordering --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("pattern", "size"), [
    (nn.ReLU, 1), ((nn.ReLU,), 1), ((nn.ReLU, nn.Conv2d), 2), (RESNET_TAIL, 5),
    ((getattr, "shape"), 2), ((operator.getitem, (getattr, "shape"), 0), 4),
])
def test_pattern_size_counts_leaves(pattern, size):
    assert pattern_size(pattern) == size


def test_sort_patterns_tuples_first_longer_first_ties_stable():
    conv_relu = (nn.ReLU, nn.Conv2d)
    linear_relu = (F.relu, nn.Linear)
    one_tuple = (F.relu,)
    given_order = [nn.ReLU, one_tuple, conv_relu, F.relu, RESNET_TAIL, linear_relu,
                   (nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))]
    assert sort_patterns(given_order) == [
        RESNET_TAIL, (nn.ReLU, (nn.BatchNorm2d, nn.Conv2d)), conv_relu, linear_relu, one_tuple,
        nn.ReLU, F.relu]


def test_sort_patterns_accepts_dict_keys_and_keeps_insertion_order_on_ties():
    patterns = {(nn.ReLU, nn.Linear): "b", (nn.ReLU, nn.Conv2d): "a"}
    assert sort_patterns(patterns) == [(nn.ReLU, nn.Linear), (nn.ReLU, nn.Conv2d)]


# -- printing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("pattern", "text"), [
    (RESNET_TAIL, "ReLU <- operator.add(*, BatchNorm2d <- Conv2d)"),
    ((nn.ReLU, (nn.BatchNorm2d, nn.Conv2d)), "ReLU <- BatchNorm2d <- Conv2d"),
    ((F.relu, nn.Linear), "F.relu <- Linear"),
    ((F.linear, MatchAllNode, MatchAllNode, MatchAllNode), "F.linear(*, *, *)"),
    ((torch.relu, (torch.add, MatchAllNode, MatchAllNode)), "torch.relu <- torch.add(*, *)"),
    (("relu", nn.Conv2d), ".relu() <- Conv2d"),
    (("add", MatchAllNode, 1.0), ".add(*, 1.0)"),
    ((operator.getitem, (getattr, "shape"), 0), "operator.getitem(.shape, 0)"),
    ((torch.ops.aten.relu.default, MatchAllNode), "aten.relu.default <- *"),
    ((F.relu,), "(F.relu,)"),
    (F.relu, "F.relu"),
    (MatchAllNode, "*"),
])
def test_format_pattern(pattern, text):
    assert format_pattern(pattern) == text


def test_format_pattern_distinguishes_the_four_relus():
    texts = {format_pattern(p) for p in (nn.ReLU, F.relu, torch.relu, "relu")}
    assert texts == {"ReLU", "F.relu", "torch.relu", ".relu()"}
