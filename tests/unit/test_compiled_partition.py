"""CompiledPartition's serialized models and deep copies: ``sources`` serializes an item only when
it is read (it re-exported every signature at each read), and a deep copy runs the models
already compiled (it exported and compiled each signature again)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

from qplug_core.partition.compiled import CompiledPartition


class Counting:
    """A serialize step that records the input shapes of each call (one call: one export)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, partition: fx.GraphModule, inputs: tuple) -> bytes:
        self.calls.append(tuple(tuple(x.shape) for x in inputs))
        return repr(self.calls[-1]).encode()


class Runtime(CompiledPartition):
    """Stands for a runtime: a compiled form is a new object per build, run as the partition."""

    def build(self, source: bytes) -> dict:
        return {"source": source}

    def run(self, compiled: dict, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        return [self.partition(*inputs)]


def _compiled_twice() -> tuple[Runtime, Counting]:
    """A partition compiled for batch 2 and then batch 3, and its serialize step, reset."""
    serialize = Counting()
    partition = Runtime(fx.symbolic_trace(nn.Sequential(nn.Linear(4, 3), nn.ReLU())), (torch.randn(2, 4),),
                        serialize)
    partition(torch.randn(3, 4))
    assert serialize.calls == [((2, 4),), ((3, 4),)]
    serialize.calls.clear()
    return partition, serialize


def test_sources_serialize_an_item_at_its_first_read_only():
    partition, serialize = _compiled_twice()
    sources = partition.sources
    assert len(sources) == 2 and serialize.calls == []
    assert sources[1] == sources[-1] == b"((3, 4),)"
    assert serialize.calls == [((3, 4),)]  # read three times, serialized once
    assert list(sources) == [b"((2, 4),)", b"((3, 4),)"]
    assert serialize.calls == [((3, 4),), ((2, 4),)]


def test_a_deep_copy_runs_the_same_compiled_models_and_recompiles_on_its_own():
    partition, serialize = _compiled_twice()
    compiled = partition.compiled
    clone = copy.deepcopy(partition)
    assert serialize.calls == []
    assert all(a is b for a, b in zip(clone.compiled, compiled, strict=True))
    x = torch.randn(2, 4)
    assert torch.equal(clone(x), partition(x))
    assert clone.form is not partition.form
    clone.recompile()  # e.g. after new settings: the copy's models only
    assert sorted(serialize.calls) == [((2, 4),), ((3, 4),)]
    assert not any(a is b for a, b in zip(clone.compiled, compiled, strict=True))
    assert {id(c) for c in partition.compiled} == {id(c) for c in compiled}
    clone(torch.randn(5, 4))  # a new signature compiles for the copy alone
    assert (len(clone.compiled), len(partition.compiled)) == (3, 2)


def test_models_past_the_cache_size_free_the_least_recently_used_and_say_so_once():
    partition, serialize = _compiled_twice()  # (2, 4) then (3, 4)
    partition.shape_cache_size = 2
    partition(torch.randn(2, 4))  # (3, 4) is now the least recently used
    with pytest.warns(UserWarning, match="shape_cache_size") as warned:
        for batch in (5, 6):
            x = torch.randn(batch, 4)
            assert torch.equal(partition(x), partition.form(x))
    assert len(warned) == 1 and len(partition.compiled) == 2
    partition(torch.randn(6, 4))
    partition(torch.randn(3, 4))  # freed: compiled again
    assert serialize.calls == [((5, 4),), ((6, 4),), ((3, 4),)]
    assert len(partition.compiled) == 2
