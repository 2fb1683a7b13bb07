"""A delegate's compiled module that is not a :class:`CompiledPartition`, as a model runs it.

A ``compile`` may return any ``nn.Module``; its exceptions reached the user as the runtime raised
them, naming neither the plugin nor the partition. :class:`ServedPartition` holds the module and
its reference form, and answers a call the module raises on with the reference form, as a
``CompiledPartition`` does (:func:`~qplug_core.partition.compiled.reference_answer`): inputs of
that signature run the reference form from then on, with one warning and the report's record of
the partition (the pipeline's :class:`~qplug_core.partition.compiled.SignatureCheck`). Attributes
the module has are read through (``qmodel.delegate_0.<your attribute>``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from qplug_core.errors import QplugError
from qplug_core.partition.compiled import (
    SignatureCheck,
    described_signature,
    failure_reason,
    input_signature,
    reference_answer,
)
from qplug_core.partition.held import HoldsPartition


class ServedPartition(HoldsPartition, nn.Module):
    """Runs ``compiled_module``; the reference form for inputs it raised on (see the module docstring)."""

    def __init__(self, compiled_module: nn.Module, partition: fx.GraphModule, check: SignatureCheck):
        super().__init__()
        self.compiled_module = compiled_module
        self.__dict__["_partition"] = partition  # not a submodule: it is not part of the state
        self.__dict__["check"] = check
        #: input signature -> why it runs the reference form
        self.refused: dict[tuple, str] = {}

    def forward(self, *inputs: torch.Tensor):
        if self.refused and input_signature(inputs) in self.refused:
            return self.__dict__["_reference_form"](*inputs)
        try:
            return self._modules["compiled_module"](*inputs)  # not through __getattr__: ~1 us a call
        except QplugError:
            raise
        except Exception as error:
            reference = self.__dict__.get("_reference_form") or self.partition  # built once: it may be held as int8
            outputs = reference_answer(reference, inputs, error, self.check)
            self.__dict__["_reference_form"] = reference
            signature = input_signature(inputs)
            if signature not in self.refused:
                self.refused[signature] = reason = failure_reason(error)
                self.check.refused(described_signature(signature), reason)
            return outputs

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if name == "compiled_module" or "compiled_module" not in modules:
                raise
            return getattr(modules["compiled_module"], name)


def runs(module: nn.Module) -> nn.Module:
    """The module a delegate's compile returned, where ``module`` serves it (reports name its type)."""
    return module.compiled_module if isinstance(module, ServedPartition) else module


__all__ = ["ServedPartition", "runs"]
