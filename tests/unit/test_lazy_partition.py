"""LazyPartition: what ``qp.load`` puts in place of a delegated partition (issue 25).

It compiles once, at the first call, on that call's inputs, from any number of threads; a compile
that fails raises a BackendError saying how to load the reference form, instead of quietly
running something else than what was saved.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import fx, nn

from qplug_core.errors import BackendError
from qplug_core.partition.lazy import LazyPartition


def _partition() -> fx.GraphModule:
    return fx.symbolic_trace(nn.Sequential(nn.Linear(4, 3), nn.ReLU()))


class Recording:
    """A compile step that keeps the shapes it was given and returns the partition itself."""

    def __init__(self) -> None:
        self.shapes: list[tuple] = []
        self.lock = threading.Lock()

    def __call__(self, partition: fx.GraphModule, inputs: tuple) -> nn.Module:
        with self.lock:
            self.shapes.append(tuple(t.shape for t in inputs))
        return partition


def test_compiles_once_on_the_first_inputs_from_any_number_of_threads():
    partition, compile_step = _partition(), Recording()
    lazy = LazyPartition(partition, compile_step, name="delegate_0", backend="npu")
    x = torch.randn(5, 4)
    results = [None] * 8

    def call(i: int) -> None:
        results[i] = lazy(x)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compile_step.shapes == [((5, 4),)]
    for result in results:
        assert torch.equal(result, partition(x))
    lazy(torch.randn(2, 4))  # later shapes go to the compiled module
    assert compile_step.shapes == [((5, 4),)]


def test_a_failing_compile_raises_naming_the_partition_and_the_way_out():
    def refuse(partition, inputs):
        raise RuntimeError("no kernel for this tile size")

    lazy = LazyPartition(_partition(), refuse, name="delegate_3", backend="npu")
    with pytest.raises(BackendError, match=r"backend 'npu' compiled partition delegate_3 when the model was "
                                           r"converted, but compiling it for these inputs failed \(RuntimeError: "
                                           r"no kernel for this tile size\); qp.load\(path, backend='reference'\)"):
        lazy(torch.randn(5, 4))


def test_a_copy_compiles_on_its_own():
    compile_step = Recording()
    lazy = LazyPartition(_partition(), compile_step, name="delegate_0", backend="npu")
    clone = copy.deepcopy(lazy)
    clone(torch.randn(1, 4))
    assert lazy.compiled is None and clone.compiled is not None and len(compile_step.shapes) == 1
