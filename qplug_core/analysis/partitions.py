"""Per-layer comparison of a delegated model, measured on what runs: its compiled partitions.

A delegate backend (ONNX Runtime, an NPU SDK) replaces whole subgraphs by compiled modules, so
the float model's layer names no longer exist in the int8 model and name-by-name comparison finds
nothing, or only the float ops around the partitions. Here every compiled partition is run on the
inputs it really receives in the int8 model and its output compared with

* its **reference form** (the same partition before compiling, rebuilt from the model's recorded
  reference form and partitioned again by the backend's delegate): what the compiler changed;
* its **float form** (the reference partition with every Quantize/Dequantize an identity, fed the
  float values before quantization, and the float model's own layers where the float model has a
  module of the same name and type): what int8 changed.

Quantized outputs are compared after dequantizing them with the Dequantize that reads them.
Integer and bool outputs that no Dequantize reads (topk indices, argmax masks: post-processing
compiled into the partition) are not measurements: a near-tie picks another index, 1,000 apart.
They are compared for equality (``integer_agreement``) and kept out of the SQNR figures.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx, nn

from qplug_core.analysis.layers import ErrorStats, LayerComparison
from qplug_core.errors import QplugError
from qplug_core.flows.delegate import PREFIX, delegate_graph
from qplug_core.flows.tags import REPORT, recorded_example_inputs
from qplug_core.kernels.reference import Dequantize, Quantize, ReferenceWeighted
from qplug_core.registry.backends import get_backend
from qplug_core.serialization.api import rebuild_reference

__all__ = ["PartitionComparisons", "partition_comparisons"]


def _is_partition(node: fx.Node) -> bool:
    return node.op == "call_module" and str(node.target).startswith(PREFIX)


def _reference_partitions(qmodel: fx.GraphModule, names: set[str]) -> dict[str, fx.GraphModule]:
    """Each compiled partition's reference form, by name (partitioning again is deterministic)."""
    report = qmodel.meta[REPORT]
    delegate = get_backend(report.backend).delegate
    reference = rebuild_reference(qmodel)
    keep = dataclasses.replace(delegate, compile=lambda partition, example_inputs: partition)
    delegate_graph(reference, keep, recorded_example_inputs(reference), report.backend)
    found = {name: reference.get_submodule(name) for name in names
             if isinstance(getattr(reference, name, None), fx.GraphModule)}
    return found if set(found) == names else {}


class _Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _float_form(partition: fx.GraphModule, float_model: nn.Module) -> fx.GraphModule:
    """The partition computing in float: no quantize/dequantize, float weights where known."""
    floats = dict(float_model.named_modules())
    form = copy.deepcopy(partition)
    for name, module in list(form.named_modules()):
        if isinstance(module, (Quantize, Dequantize)):
            form.set_submodule(name, _Identity())
        elif isinstance(module, ReferenceWeighted):
            original = floats.get(name)
            if original is not None and type(original) is type(module.module):
                form.set_submodule(name, original)
    return form


class _Recorder(fx.Interpreter):
    """Runs the int8 model and keeps, per partition call, its inputs, the float values its integer
    inputs were quantized from, and its outputs."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.modules = dict(gm.named_modules())
        self.float_of: dict[fx.Node, Any] = {}
        self.calls: list[tuple[str, tuple, tuple, tuple]] = []

    def run_node(self, node: fx.Node) -> Any:
        args, _ = self.fetch_args_kwargs_from_env(node)
        result = super().run_node(node)
        if node.op == "call_module" and isinstance(self.modules[str(node.target)], Quantize):
            self.float_of[node] = args[0]
        if _is_partition(node):
            floats = tuple(self.float_of.get(a, v) if isinstance(a, fx.Node) else v
                           for a, v in zip(node.args, args))
            outputs = result if isinstance(result, (tuple, list)) else (result,)
            self.calls.append((str(node.target), tuple(args), floats, tuple(outputs)))
        return result


def _dequantize_reading(modules: dict[str, nn.Module], node: fx.Node) -> nn.Module | None:
    for user in node.users:
        module = modules.get(str(user.target)) if user.op == "call_module" else None
        if isinstance(module, Dequantize):
            return module
    return None


def _readers(gm: fx.GraphModule, node: fx.Node) -> dict[int, nn.Module | None]:
    """Output index -> the Dequantize reading that output of a partition call (None: none)."""
    modules = dict(gm.named_modules())
    items = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
    if not items:  # one output
        return {0: _dequantize_reading(modules, node)}
    return {int(u.args[1]): _dequantize_reading(modules, u) for u in items}


def _as_float(value: torch.Tensor, reader: nn.Module | None) -> torch.Tensor:
    if value.is_floating_point():
        return value
    return reader(value) if reader is not None else value.to(torch.float32)


class _Agreement:
    """Running count of equal elements of integer outputs."""

    def __init__(self) -> None:
        self.equal = self.total = 0

    def update(self, reference: torch.Tensor, test: torch.Tensor) -> None:
        self.equal += int((reference == test).sum())
        self.total += reference.numel()

    @property
    def fraction(self) -> float | None:
        return self.equal / self.total if self.total else None


@dataclasses.dataclass
class PartitionComparisons:
    """One row per compiled partition, and the layers inside them (name -> partition): those
    do not run as themselves, so a per-layer row for them would describe the reference form."""

    rows: list[LayerComparison] = dataclasses.field(default_factory=list)
    inside: dict[str, str] = dataclasses.field(default_factory=dict)


def partition_comparisons(float_model: nn.Module, qmodel: nn.Module,
                          batches: Iterable[tuple]) -> PartitionComparisons:
    """Rows for the compiled partitions of ``qmodel`` (none for a model without partitions):
    ``sqnr_db`` against the float form, ``reference_sqnr_db`` against the reference form."""
    if not isinstance(qmodel, fx.GraphModule) or REPORT not in qmodel.meta:
        return PartitionComparisons()
    calls = {str(n.target): n for n in qmodel.graph.nodes if _is_partition(n)}
    if not calls:
        return PartitionComparisons()
    try:
        references = _reference_partitions(qmodel, set(calls))
    except QplugError:  # no recorded reference form (not savable): nothing to measure against
        return PartitionComparisons()
    if not references:
        return PartitionComparisons()
    inside = {str(n.target): name for name, partition in references.items()
              for n in partition.graph.nodes if n.op == "call_module"}
    readers = {name: _readers(qmodel, node) for name, node in calls.items()}
    vs_float = {name: ErrorStats() for name in calls}
    vs_reference = {name: ErrorStats() for name in calls}
    agreement = {name: _Agreement() for name in calls}
    shapes: dict[str, tuple[int, ...]] = {}
    counts = dict.fromkeys(calls, 0)
    for args in batches:
        recorder = _Recorder(qmodel)
        recorder.run(*args)
        for name, inputs, floats, outputs in recorder.calls:
            reference = references[name](*inputs)
            reference = reference if isinstance(reference, (tuple, list)) else (reference,)
            float_out = _float_form(references[name], float_model)(*floats)
            float_out = float_out if isinstance(float_out, (tuple, list)) else (float_out,)
            for i, (got, want, exact) in enumerate(zip(outputs, reference, float_out)):
                reader = readers[name].get(i)
                if reader is None and not got.is_floating_point():  # indices, masks (module docstring)
                    agreement[name].update(exact, got)
                    continue
                got_f = _as_float(got, reader)
                vs_reference[name].update(_as_float(want, reader), got_f)
                vs_float[name].update(exact, got_f)
                shapes.setdefault(name, tuple(got.shape))
            counts[name] += len(outputs)
    modules = dict(qmodel.named_modules())
    return PartitionComparisons([LayerComparison(
        name=name, float_type="float form", quant_type=type(modules[name]).__name__,
        sqnr_db=vs_float[name].sqnr_db, max_abs_err=vs_float[name].max_abs,
        rel_l2_err=vs_float[name].rel_l2_err, cosine=vs_float[name].cosine,
        shape=shapes.get(name, ()), num_outputs=counts[name],
        reference_sqnr_db=vs_reference[name].sqnr_db, integer_agreement=agreement[name].fraction)
        for name in calls if counts[name]], inside)
