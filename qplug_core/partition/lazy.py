"""A delegated partition compiled at its first call, on the inputs it is first called with.

``qp.load`` rebuilds a delegating backend's partitions without running the model: a compiler
needs example inputs, and the only shapes a file offers are the ones it records, which a tampered
file can make as large as it likes (a 6.7 KB file asking for zeros of shape [16777216, 8] took
83 s and 3.4 GB to load). So loading swaps in :class:`LazyPartition` for each partition that was
compiled at convert, and the partition is compiled from the user's own first inputs. A compile
that fails then raises (the model was compiled when it was converted, so falling back would make
the loaded model answer differently from the saved one) and says how to load the reference form.
Where the file stores the partition's compiled models, those are what is built at the first call;
first inputs none of them serves (batch 1 where they take batch 2 and up) are then compiled as a
new signature, as in memory: a failure runs the reference form for it, with the same warning.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch
from torch import fx, nn

from qplug_core.errors import BackendError, InputMismatchError
from qplug_core.partition.held import HeldForm, HoldsPartition

Compile = Callable[[fx.GraphModule, tuple[torch.Tensor, ...]], nn.Module]


class LazyPartition(HoldsPartition, nn.Module):
    """Runs ``compile(partition, first_inputs)``'s module; compiles once, thread-safely."""

    def __init__(self, partition: fx.GraphModule | HeldForm, compile: Compile, *, name: str, backend: str):
        super().__init__()
        self.__dict__["_partition"] = partition  # not a submodule: the compiled module replaces it
        self._compile_fn = compile
        self.partition_name, self.backend = name, backend
        self.compiled: nn.Module | None = None
        self._lock = threading.Lock()

    def forward(self, *inputs: torch.Tensor):
        compiled = self.compiled
        if compiled is None and any(isinstance(x, torch.Tensor) and x.numel() == 0 for x in inputs):
            return self.partition(*inputs)  # an empty batch compiles nothing (OpenVINO refuses size 0)
        if compiled is None:
            with self._lock:
                if self.compiled is None:
                    self.compiled = self._build(inputs)
                compiled = self.compiled
        return compiled(*inputs)

    def _build(self, inputs: tuple[torch.Tensor, ...]) -> nn.Module:
        partition = self.partition
        try:
            with torch.no_grad():
                compiled = self._compile_fn(partition, tuple(inputs))
        except InputMismatchError:
            raise  # the caller's inputs, not the backend
        except Exception as exc:
            raise BackendError(
                f"backend {self.backend!r} compiled partition {self.partition_name} when the model was "
                f"converted, but compiling it for these inputs failed ({type(exc).__name__}: {exc}); "
                "qp.load(path, backend='reference') gives the reference form, which runs anywhere",
                backend=self.backend) from exc
        if isinstance(compiled, HoldsPartition) and compiled.form is partition:
            compiled.hold(self.__dict__["_partition"])  # the form this one holds, not a float copy
        return compiled

    def __deepcopy__(self, memo: dict) -> LazyPartition:
        # a compile step that holds per-model state says how it is copied; others are shared
        compile_fn = (copy.deepcopy(self._compile_fn, memo) if hasattr(self._compile_fn, "__deepcopy__")
                      else self._compile_fn)
        clone = LazyPartition(copy.deepcopy(self.__dict__["_partition"], memo), compile_fn,
                              name=self.partition_name, backend=self.backend)
        if self.compiled is not None:
            clone.compiled = copy.deepcopy(self.compiled, memo)
        return clone

    def extra_repr(self) -> str:
        return f"{self.partition_name}, backend={self.backend!r}, compiled={self.compiled is not None}"


__all__ = ["LazyPartition"]
