"""CompiledPartition's serialized models and deep copies: each compiled model's source is kept
beside it (a rebuild and ``qp.save`` exported every signature again), a large one in a temporary
file, and a deep copy runs the models already compiled, from the same sources (it exported and
compiled each signature again)."""

from __future__ import annotations

import copy
import errno
import gc
import os
import tempfile
from collections import OrderedDict

import pytest
import torch
from torch import fx, nn

from qplug_core.partition import compiled as compiled_module
from qplug_core.partition.compiled import CompiledPartition
from qplug_core.partition.source_file import SourceFile, in_memory, whole_model


@pytest.fixture(autouse=True)
def room_in_memory(monkeypatch):
    """Room for these tests' sources whatever the process's other models keep (a budget of the process)."""
    monkeypatch.setattr(compiled_module, "SOURCE_BYTES_IN_MEMORY", in_memory() + 2**20)


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


def _compiled_once(serialize: Counting) -> Runtime:
    return Runtime(fx.symbolic_trace(nn.Sequential(nn.Linear(4, 3), nn.ReLU())), (torch.randn(2, 4),), serialize)


def _compiled_twice() -> tuple[Runtime, Counting]:
    """A partition compiled for batch 2 and then batch 3, and its serialize step, reset."""
    serialize = Counting()
    partition = _compiled_once(serialize)
    partition(torch.randn(3, 4))
    assert serialize.calls == [((2, 4),), ((3, 4),)]
    serialize.calls.clear()
    return partition, serialize


def test_recompile_builds_the_kept_sources_again_without_serializing():
    partition, serialize = _compiled_twice()
    built = partition.compiled
    assert partition.sources == [b"((2, 4),)", b"((3, 4),)"]
    partition.recompile()  # e.g. after new settings
    assert serialize.calls == []
    assert [c["source"] for c in partition.compiled] == [b"((2, 4),)", b"((3, 4),)"]
    assert not any(a is b for a, b in zip(partition.compiled, built, strict=True))


def test_sources_past_the_bytes_kept_in_memory_are_kept_in_a_file_removed_with_the_last_holder(monkeypatch):
    monkeypatch.setattr(compiled_module, "SOURCE_BYTES_IN_MEMORY", in_memory() + 12)  # each source: 9 bytes
    partition, serialize = _compiled_twice()
    as_bytes, in_file = partition.sources
    assert as_bytes == b"((2, 4),)" and isinstance(in_file, SourceFile)
    assert partition.compiled[1]["source"] is in_file  # built from the file, not from bytes
    assert whole_model(in_file) == b"((3, 4),)"
    clone = copy.deepcopy(partition)
    assert clone.sources[1] is in_file
    directory = os.path.dirname(in_file)
    del partition, in_file
    gc.collect()
    assert os.path.isdir(directory)  # the copy holds it
    del clone
    gc.collect()
    assert not os.path.exists(directory)
    assert serialize.calls == []


def test_a_deep_copy_runs_the_same_compiled_models_and_recompiles_on_its_own():
    partition, serialize = _compiled_twice()
    compiled = partition.compiled
    clone = copy.deepcopy(partition)
    assert serialize.calls == []
    assert all(a is b for a, b in zip(clone.compiled, compiled, strict=True))
    x = torch.randn(2, 4)
    assert torch.equal(clone(x), partition(x))
    assert clone.form is not partition.form
    assert all(a is b for a, b in zip(clone.sources, partition.sources, strict=True))
    clone.recompile()  # e.g. after new settings: the copy's models only, from the sources shared
    assert serialize.calls == []
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
    assert partition.sources == [b"((5, 4),)", b"((6, 4),)"]  # freed with their models
    partition(torch.randn(3, 4))  # freed: compiled again
    assert serialize.calls == [((5, 4),), ((6, 4),), ((3, 4),)]
    assert len(partition.compiled) == 2


def test_the_bytes_kept_in_memory_are_a_budget_of_the_process_not_of_each_partition(monkeypatch):
    """24 partitions of 4 MiB each kept 97 MiB in memory on OpenVINO under a per-partition cap."""
    monkeypatch.setattr(compiled_module, "SOURCE_BYTES_IN_MEMORY", in_memory() + 30)  # 3 sources of 9 bytes
    partitions = [_compiled_once(Counting()) for _ in range(10)]
    kept = [p.sources[0] for p in partitions]
    assert [isinstance(source, bytes) for source in kept] == [True] * 3 + [False] * 7
    assert all(whole_model(source) == b"((2, 4),)" for source in kept)
    del partitions[0], kept
    gc.collect()
    partitions.append(_compiled_once(Counting()))  # the room the deleted one gave back
    assert isinstance(partitions[-1].sources[0], bytes)
    del partitions
    gc.collect()
    assert in_memory() == compiled_module.SOURCE_BYTES_IN_MEMORY - 30


def test_a_source_that_cannot_be_kept_leaves_the_partition_compiled_and_is_serialized_again(monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(compiled_module, "SOURCE_BYTES_IN_MEMORY", 0)
    monkeypatch.setattr(tempfile, "mkdtemp", full)
    serialize = Counting()
    with pytest.warns(UserWarning, match="No space left on device; the partition runs without it") as warned:
        partition = _compiled_once(serialize)
        partition(torch.randn(3, 4))
    assert len(warned) == 1 and len(partition.compiled) == 2
    assert partition.sources == [b"((2, 4),)", b"((3, 4),)"]  # serialized again (qp.save)
    assert serialize.calls == [((2, 4),), ((3, 4),)] * 2
    x = torch.randn(2, 4)
    assert torch.equal(partition(x), partition.form(x))


def test_a_signature_s_source_is_kept_before_its_compiled_model_is_seen():
    """``qp.save`` during a first call of a new shape read the new model's source before it was kept
    (KeyError): ``sources`` reads the models, then their sources."""
    partition, _ = _compiled_twice()
    seen = []

    class Watched(OrderedDict):
        def __setitem__(self, signature, compiled) -> None:
            super().__setitem__(signature, compiled)
            seen.append(signature in partition._sources)

    partition._compiled = Watched(partition._compiled)
    seen.clear()
    partition(torch.randn(5, 4))
    assert seen == [True]
