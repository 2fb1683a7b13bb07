"""``CompiledPartition``: the module a compiling backend's delegate puts in place of a partition.

Every runtime that compiles a serialized model (ONNX Runtime sessions, OpenVINO compiled models,
an NPU SDK) needs the same bookkeeping around its own two steps: the reference-form partition kept
outside the module tree (to serialize it again for another input shape), one compiled model per
input signature, the output structure (tensor or tuple), and a deep copy that compiles its own
models (compiled runtimes cannot be copied). A subclass gives :meth:`build` (serialized model ->
the runtime's compiled form) and :meth:`run` (compiled form, inputs -> output tensors).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn


class CompiledPartition(nn.Module):
    """Runs one partition in a runtime; ``serialize(partition, inputs)`` gives the bytes
    :meth:`build` compiles (e.g. ``plugin_api.to_onnx_proto(...).SerializeToString()``)."""

    def __init__(self, partition: fx.GraphModule, example_inputs: tuple[torch.Tensor, ...],
                 serialize: Callable[[fx.GraphModule, tuple], bytes]):
        super().__init__()
        self.__dict__["_partition"] = partition  # not a submodule: it is not part of the state
        self._serialize = serialize
        self._sources: dict[tuple, bytes] = {}
        self._compiled: dict[tuple, Any] = {}
        self._single_output = True
        self._compile(example_inputs)

    def build(self, source: bytes) -> Any:
        """The runtime's compiled form of one serialized partition (with the settings in force)."""
        raise NotImplementedError

    def run(self, compiled: Any, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The partition's outputs for ``inputs``, computed by ``compiled``."""
        raise NotImplementedError

    @property
    def partition(self) -> fx.GraphModule:
        """The reference-form partition this module runs."""
        return self.__dict__["_partition"]

    @staticmethod
    def as_array(tensor: torch.Tensor) -> Any:
        """A numpy view of ``tensor``'s buffer for the runtime (a contiguous copy first if it is
        not contiguous); ``detach`` only when it requires grad: it costs a microsecond per call."""
        if tensor.requires_grad:
            tensor = tensor.detach()
        return tensor.contiguous().numpy()

    @staticmethod
    def _signature(inputs) -> tuple:
        return tuple([(t.shape, t.dtype) for t in inputs])  # torch.Size is a tuple: hashable

    def _compile(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        with torch.no_grad():  # the output structure (tensor or tuple) the partition returns
            self._single_output = isinstance(self.partition(*inputs), torch.Tensor)
        signature = self._signature(inputs)
        self._sources[signature] = self._serialize(self.partition, inputs)
        self._compiled[signature] = compiled = self.build(self._sources[signature])
        return compiled

    def recompile(self) -> None:
        """Build every compiled model again (after a change of settings)."""
        self._compiled = {signature: self.build(source) for signature, source in self._sources.items()}

    @property
    def sources(self) -> list[bytes]:
        """The serialized partitions compiled so far (one per input signature)."""
        return list(self._sources.values())

    @property
    def compiled(self) -> list[Any]:
        """The compiled forms built so far (one per input signature)."""
        return list(self._compiled.values())

    def forward(self, *inputs: torch.Tensor):
        # at batch 1 on a small model the runtime takes ~20 us: every microsecond here counts
        compiled = self._compiled.get(self._signature(inputs))
        if compiled is None:
            compiled = self._compile(inputs)
        outputs = self.run(compiled, inputs)
        return outputs[0] if self._single_output else tuple(outputs)

    def __deepcopy__(self, memo: dict) -> CompiledPartition:
        """The copy compiles its own models from the same serialized partitions."""
        clone = type(self).__new__(type(self))
        nn.Module.__init__(clone)
        for key, value in self.__dict__.items():
            clone.__dict__.setdefault(key, value)  # settings and the like (nn.Module's own are fresh)
        clone.training = self.training
        clone.__dict__["_partition"] = copy.deepcopy(self.partition, memo)
        clone._sources = dict(self._sources)
        clone.recompile()
        return clone
