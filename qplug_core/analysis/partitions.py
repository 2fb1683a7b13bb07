"""Per-layer comparison of a delegated model, measured on what runs: its compiled partitions.

A delegate backend (ONNX Runtime, an NPU SDK) replaces whole subgraphs by compiled modules, so
the float model's layer names no longer exist in the int8 model and name-by-name comparison finds
nothing, or only the float ops around the partitions. Here every compiled partition is run on the
inputs it really receives in the int8 model and its output compared with

* its **reference form** (the partition its delegate compiled, as convert recorded it: the same
  inputs, whatever the contract check planned again; partitioning the reference form anew gives
  other partitions after a fallback): what the compiler changed;
* its **float form** (the reference partition with every Quantize/Dequantize an identity, fed the
  float values before quantization, and the float model's own layers where the float model has a
  module of the same name and type, each followed by the clamp convert absorbed into its int8
  range, if any: a ReLU6 its Quantize realised by saturation): what int8 changed.

Quantized outputs are compared after dequantizing them with the Dequantize that reads them.
Integer and bool outputs that no Dequantize reads (topk indices, argmax masks: post-processing
compiled into the partition) are not measurements: a near-tie picks another index, 1,000 apart.
They are compared for equality (``integer_agreement``) and kept out of the SQNR figures.
A partition convert kept in reference form, or one whose forms cannot run on the inputs it
received, gets no row but a reason in ``skipped``.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import fx, nn

from qplug_core.analysis.layers import ErrorStats, LayerComparison
from qplug_core.flows.clamps import AbsorbedClamp, absorbed_clamps
from qplug_core.flows.delegate import PREFIX
from qplug_core.flows.held_forms import reference_form
from qplug_core.flows.tags import PARTITION_FORMS, REPORT
from qplug_core.kernels.reference import Dequantize, Quantize, ReferenceWeighted
from qplug_core.partition.served import runs

__all__ = ["PartitionComparisons", "partition_comparisons"]


def _is_partition(node: fx.Node) -> bool:
    return node.op == "call_module" and str(node.target).startswith(PREFIX)


def _reference_forms(qmodel: fx.GraphModule, names: Iterable[str]) -> tuple[dict[str, fx.GraphModule],
                                                                             dict[str, str]]:
    """The reference form of each partition in ``names`` that runs compiled (as convert recorded
    it), and why each other one gets no row."""
    compiled = {record["name"] for record in qmodel.meta[REPORT].partitions}
    recorded = qmodel.meta[PARTITION_FORMS]
    forms = {name: reference_form(recorded[name]) for name in names if name in compiled}
    skipped = {name: "kept in reference form at convert (qp.quantization_report(model).reference says why): "
                     "its layers run in PyTorch, compared by name where the float model has them"
               for name in names if name not in forms}
    return forms, skipped


class _Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Clamped(nn.Module):
    """A layer and the clamp convert absorbed into its int8 range (the Quantize after it clamped)."""

    def __init__(self, layer: nn.Module, clamp: AbsorbedClamp) -> None:
        super().__init__()
        self.layer, self.clamp = layer, clamp

    def forward(self, *args: Any) -> torch.Tensor:
        return self.clamp.apply(self.layer(*args))


def _float_form(partition: fx.GraphModule, float_model: nn.Module,
                clamps: Mapping[str, AbsorbedClamp]) -> fx.GraphModule:
    """The partition computing in float: no quantize/dequantize, float weights where known, and
    the clamps those quantizes realised by saturation (``clamps``) run again."""
    floats = dict(float_model.named_modules())
    form = copy.deepcopy(partition)
    for name, module in list(form.named_modules()):
        if isinstance(module, (Quantize, Dequantize)):
            form.set_submodule(name, _Identity())
        elif isinstance(module, ReferenceWeighted):
            original = floats.get(name)
            layer = original if original is not None and type(original) is type(module.module) else module
            form.set_submodule(name, layer if name not in clamps else _Clamped(layer, clamps[name]))
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


class _Measured:
    """One compiled partition's errors over its calls so far: its outputs against those of its
    reference form (same inputs) and of its float form (the float values before quantization)."""

    def __init__(self, reference: fx.GraphModule, float_model: nn.Module, readers: dict[int, nn.Module | None],
                 clamps: Mapping[str, AbsorbedClamp]):
        self.reference, self.float_form = reference, _float_form(reference, float_model, clamps)
        self.readers = readers
        self.vs_float, self.vs_reference, self.agreement = ErrorStats(), ErrorStats(), _Agreement()
        self.shape: tuple[int, ...] = ()
        self.count = 0

    def add(self, inputs: tuple, floats: tuple, outputs: tuple) -> None:
        reference, float_out = _outputs(self.reference(*inputs)), _outputs(self.float_form(*floats))
        for i, (got, want, exact) in enumerate(zip(outputs, reference, float_out)):
            reader = self.readers.get(i)
            if reader is None and not got.is_floating_point():  # indices, masks (module docstring)
                self.agreement.update(exact, got)
                continue
            got_f = _as_float(got, reader)
            self.vs_reference.update(_as_float(want, reader), got_f)
            self.vs_float.update(exact, got_f)
            self.shape = self.shape or tuple(got.shape)
        self.count += len(outputs)

    def row(self, name: str, quant_type: str) -> LayerComparison:
        return LayerComparison(
            name=name, float_type="float form", quant_type=quant_type, sqnr_db=self.vs_float.sqnr_db,
            max_abs_err=self.vs_float.max_abs, rel_l2_err=self.vs_float.rel_l2_err, cosine=self.vs_float.cosine,
            shape=self.shape, num_outputs=self.count, reference_sqnr_db=self.vs_reference.sqnr_db,
            integer_agreement=self.agreement.fraction)


def _outputs(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


@dataclasses.dataclass
class PartitionComparisons:
    """One row per compiled partition, the layers inside them (name -> partition): those do not
    run as themselves, so a per-layer row for them would describe the reference form; and the
    partitions without a row (name -> why)."""

    rows: list[LayerComparison] = dataclasses.field(default_factory=list)
    inside: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)


def partition_comparisons(float_model: nn.Module, qmodel: nn.Module,
                          batches: Iterable[tuple]) -> PartitionComparisons:
    """Rows for the compiled partitions of ``qmodel`` (none for a model without partitions):
    ``sqnr_db`` against the float form, ``reference_sqnr_db`` against the reference form."""
    if not isinstance(qmodel, fx.GraphModule) or REPORT not in qmodel.meta:
        return PartitionComparisons()
    calls = {str(n.target): n for n in qmodel.graph.nodes if _is_partition(n)}
    forms, skipped = _reference_forms(qmodel, calls)
    clamps = absorbed_clamps(qmodel)
    measured = {name: _Measured(form, float_model, _readers(qmodel, calls[name]), clamps)
                for name, form in forms.items()}
    for args in batches:
        recorder = _Recorder(qmodel)
        recorder.run(*args)
        for name, inputs, floats, outputs in recorder.calls:
            if name not in measured:
                continue
            try:
                measured[name].add(inputs, floats, outputs)
            except Exception as exc:  # noqa: BLE001 - a row that cannot be computed is skipped, with why
                del measured[name]
                skipped[name] = (f"not measured: its reference or float form failed on the inputs it received "
                                 f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); the float form "
                                 "runs float_model's layers of the same names and types: pass the model that "
                                 "was quantized (or qp.fuse_fx of it)")
    rows = {name: errors for name, errors in measured.items() if errors.count}
    inside = {str(n.target): name for name, errors in rows.items()
              for n in errors.reference.graph.nodes if n.op == "call_module"}
    modules = dict(qmodel.named_modules())
    return PartitionComparisons([errors.row(name, type(runs(modules[name])).__name__) for name, errors in rows.items()],
                                inside, skipped)
