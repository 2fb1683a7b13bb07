"""Delegation: a backend whose runtime compiles whole subgraphs (ONNX Runtime, an NPU SDK).

Instead of (or besides) per-op kernels, such a backend gives a
:class:`~qplug_core.registry.contract.Delegate` through the
``qplug_delegate`` hook: an ``OperatorSupportBase`` saying which nodes of the reference form it
takes, and a ``compile`` function turning one partition (a GraphModule in reference form, plus
example inputs) into one module. The core groups the supported nodes with
``CapabilityBasedPartitioner``, keeps only partitions holding int8 work, fuses each into a
submodule and swaps in the compiled module. Everything else stays in PyTorch, and the report lists
the partitions and every node left outside with the reason.

A compiled partition is checked like a lowered kernel (:mod:`qplug_core.flows.kernel_check`): run
on the inputs it saw when the reference form ran on the example inputs, each output must be
within the contract's steps of the reference partition's. A partition of several int8 regions
whose outputs are not within that contract (roundings drift through a deep partition, or one
region is wrong) is checked region by region (:mod:`qplug_core.flows.region_parity`: each region
compiled by the same compile function, side by side in one check-only module, fed the reference
partition's own integer inputs): each region's integers within one step of the reference's on
>= 99% of its elements. That costs one more compile, so only where the outputs call for it. One
that fails either where the backend's kernels sum u8 x s8 pairs in int16 (ONNX Runtime's fused
U8S8 kernels on a CPU without VNNI under 8-bit weights) is compiled and checked once more with
7-bit weights (:mod:`qplug_core.flows.safer_weights`; a warning and the report's partition note
say so). One that still fails (an SDK wrong in one inner layer) keeps the reference form, with a
warning naming the partition, the region and the plugin, and the report says why. After
``qp.load``, where the file's weights may saturate on this CPU (converted on one with VNNI), the
same check runs at a partition's first call, on its first inputs (:class:`FirstCallCheck`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from qplug_core.flows.kernel_check import CONTRACT_BROKEN, MAX_OUTLIER_FRACTION, output_violation
from qplug_core.flows.region_parity import layer_parity
from qplug_core.flows.report import describe_op, float_compute_nodes, report_names
from qplug_core.flows.safer_weights import make_safer, may_saturate
from qplug_core.flows.tags import BOUNDARY, KERNEL, REPORT, region_tag
from qplug_core.partition import CapabilityBasedPartitioner
from qplug_core.partition.lazy import LazyPartition
from qplug_core.partition.sole import install as install_sole_call
from qplug_core.registry.contract import Delegate

#: a region of a multi-region partition must agree with the reference within one integer step ...
REGION_STEPS = 1
#: ... on at least this fraction of its elements (ORT and OpenVINO: 100% on every zoo model)
REGION_MIN_WITHIN = 0.99
#: the prefix of the submodules holding compiled partitions (``delegate_0``, ...)
PREFIX = "delegate_"
_CALLS = ("call_module", "call_function", "call_method")


@dataclass
class PartitionRecord:
    """One compiled partition: its submodule, size, int8 regions and what it runs on."""

    name: str
    nodes: int
    int8_regions: int
    module: str
    note: str = ""  # what was changed for it to keep the contract (safer weights), if anything


@dataclass
class DelegationSummary:
    partitions: list[PartitionRecord] = field(default_factory=list)
    outside: dict[str, str] = field(default_factory=dict)  # node name -> why it stayed in PyTorch
    lowered: dict[str, str] = field(default_factory=dict)  # int8 anchor -> partition
    reference: dict[str, str] = field(default_factory=dict)  # int8 anchor left in reference form -> why
    #: partition submodule -> its reference form: the report looks inside for ops left in float
    graphs: dict[str, fx.GraphModule] = field(default_factory=dict)


#: names an int8 anchor as the report does (``flows.report.report_names``)
_Namer = Callable[[fx.Node], str]


def _int8_anchors(nodes: Iterable[fx.Node], name: _Namer) -> list[str]:
    return [name(n) for n in nodes if (tag := region_tag(n)) is not None and tag.is_anchor and tag.quantized]


class _PartitionInputs(fx.Interpreter):
    """Runs the graph once and keeps the inputs each delegate submodule is called with."""

    def __init__(self, gm: fx.GraphModule, names: set[str]):
        super().__init__(gm)
        self.names = names
        self.inputs: dict[str, tuple] = {}

    def call_module(self, target, args, kwargs):
        if target in self.names:
            self.inputs[target] = tuple(args)
        return super().call_module(target, args, kwargs)


def delegate_graph(gm: fx.GraphModule, delegate: Delegate, example_inputs: tuple | None,
                   backend_name: str, keep_reference: dict[str, str] | None = None,
                   arithmetic: Any = None) -> DelegationSummary:
    """Partition ``gm`` (reference form) for ``delegate`` and compile its int8 partitions, in place.

    ``example_inputs=None`` (``qp.load``): nothing runs now, each partition is compiled at its
    first call (:class:`~qplug_core.partition.lazy.LazyPartition`). ``keep_reference`` (int8
    anchor -> why, recorded at convert) names partitions left in reference form then: they stay so.
    ``arithmetic``: how the backend's kernels sum products (``Backend.arithmetic``): a partition
    that breaks the contract where they sum pairs in int16 is compiled once more with 7-bit
    weights (``flows/safer_weights.py``) before it is given up.
    """
    keep_reference = keep_reference or {}
    summary = DelegationSummary()
    report_key = report_names(gm.graph)  # the report's names, taken before partitions are fused
    submodules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        if node.op in _CALLS and not delegate.operator_support.is_node_supported(submodules, node):
            reason = delegate.operator_support.unsupported_reason(submodules, node)
            summary.outside[node.name] = (f"backend {backend_name!r} does not take {describe_op(node, gm)}"
                                          + (f": {reason}" if reason else ""))
    partitioner = CapabilityBasedPartitioner(
        gm, delegate.operator_support,
        allows_single_node_partition=delegate.allows_single_node_partition)
    partitions = []
    for partition in partitioner.propose_partitions():
        if _int8_anchors(partition.nodes, report_key):
            partitions.append(partition)
        else:
            for node in partition.nodes:
                if BOUNDARY not in node.meta:
                    summary.outside[node.name] = "in a partition without int8 work: left in PyTorch"
    members = {i: (list(p.nodes), _int8_anchors(p.nodes, report_key)) for i, p in enumerate(partitions)}
    partitioner.fuse_partitions(partitions, prefix=PREFIX)
    names = {f"{PREFIX}{i}" for i in members}
    recorder = _PartitionInputs(gm, names)
    if example_inputs is not None:
        with torch.no_grad():
            recorder.run(*example_inputs)
    for i, (nodes, anchors) in members.items():
        name = f"{PREFIX}{i}"
        partition_gm = gm.get_submodule(name)
        summary.graphs[name] = partition_gm
        if anchors and all(a in keep_reference for a in anchors):
            summary.reference.update({a: keep_reference[a] for a in anchors})
            continue
        if example_inputs is None:  # qp.load: compiled at the first call, checked where it may saturate
            module: nn.Module = LazyPartition(
                partition_gm, FirstCallCheck(gm.meta, delegate, name, anchors, backend_name, arithmetic),
                name=name, backend=backend_name)
            note = ""
        else:
            inputs = recorder.inputs[name]
            try:
                module = delegate.compile(partition_gm, inputs)
            except Exception as exc:  # one partition failing must not fail the conversion
                reason = f"compiling partition {name} failed ({type(exc).__name__}: {exc}); reference form kept"
                warnings.warn(f"qplug: backend {backend_name!r}: {reason}", stacklevel=3)
                summary.reference.update(dict.fromkeys(anchors, reason))
                continue
            module, note, reason = _checked(delegate, module, partition_gm, inputs, anchors, name,
                                            backend_name, arithmetic, "on the example inputs")
            if reason:
                summary.reference.update(dict.fromkeys(anchors, reason))
                continue
        gm.set_submodule(name, module)
        summary.partitions.append(PartitionRecord(name, len(nodes), len(anchors), type(module).__name__, note))
        summary.lowered.update(dict.fromkeys(anchors, name))
    for name in _int8_anchors((n for n in gm.graph.nodes if n.name in summary.outside), report_key):
        summary.reference[name] = summary.outside[name]
    compiled = {p.name for p in summary.partitions}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in compiled:
            node.meta[KERNEL] = f"delegate:{backend_name}"
    gm.graph.lint()
    gm.recompile()
    install_sole_call(gm)  # one partition: calls go straight to it (batch-1 overhead)
    return summary


def _checked(delegate: Delegate, module: nn.Module, reference: fx.GraphModule, inputs: tuple,
             anchors: list[str], name: str, backend_name: str, arithmetic: Any, on: str
             ) -> tuple[nn.Module, str, str]:
    """A compiled partition held to the contract ``on`` its ``inputs``: (the module to use, what
    was changed for it to keep the contract, why the reference form is kept instead ('' if not)).

    One that breaks it where int16 pair sums may be why is compiled again with 7-bit weights
    (changed in place on ``reference``'s modules, undone if that fails too)."""
    problem = _problem(delegate, module, reference, inputs, len(anchors))
    if not problem:
        return module, "", ""
    safer = make_safer(reference, arithmetic)
    if safer is not None:
        again_module, again = _recompiled(delegate, reference, inputs, len(anchors))
        if not again and again_module is not None:
            note = (f"compiled with 7-bit weights in {', '.join(safer.layers)}: with 8-bit ones "
                    f"it {CONTRACT_BROKEN} ({problem}; this CPU's int8 kernels sum u8 x s8 pairs "
                    "in int16)")
            warnings.warn(f"qplug: backend {backend_name!r}: partition {name} {note}", stacklevel=4)
            return again_module, note, ""
        safer.undo()
        problem += f"; with 7-bit weights too: {again}"
    reason = (f"partition {name} compiled by {_delegate_label(backend_name)} {CONTRACT_BROKEN} "
              f"{on} ({problem}); reference form kept")
    warnings.warn(f"qplug: backend {backend_name!r}: {reason}", stacklevel=4)
    return module, "", reason


class FirstCallCheck:
    """A loaded partition's compile: on a CPU where its kernels may saturate int16 pair sums
    (``flows/safer_weights.may_saturate``: converted where they could not, or with 8-bit layers
    found safe on other data), the compiled partition is checked on its first inputs as convert
    checks it on the example inputs, made safer or given up for its reference form, and the
    model's report says so. Elsewhere it only compiles: convert checked it."""

    def __init__(self, meta: dict, delegate: Delegate, name: str, anchors: list[str],
                 backend_name: str, arithmetic: Any):
        self.meta, self.delegate, self.name, self.anchors = meta, delegate, name, anchors
        self.backend_name, self.arithmetic = backend_name, arithmetic

    def __call__(self, partition: fx.GraphModule, inputs: tuple) -> nn.Module:
        module = self.delegate.compile(partition, inputs)
        if not may_saturate(partition, self.arithmetic):
            return module
        module, note, reason = _checked(self.delegate, module, partition, inputs, self.anchors,
                                        self.name, self.backend_name, self.arithmetic,
                                        "on its first inputs after qp.load on this CPU")
        report = self.meta.get(REPORT)
        if report is not None and reason:
            for anchor in self.anchors:
                report.kernels.pop(anchor, None)
                report.reference[anchor] = reason
            report.partitions = [p for p in report.partitions if p["name"] != self.name]
            for entry in report.skipped:  # its float ops now run in PyTorch
                if entry.partition == self.name:
                    entry.partition = ""
            listed = {entry.node for entry in report.skipped}
            report.skipped += [entry for entry in float_compute_nodes(partition, report.reference)
                               if entry.node not in listed]  # its int8 regions compute in float too
        elif report is not None and note:
            for record in report.partitions:
                if record["name"] == self.name:
                    record["note"] = note
        return partition if reason else module

    def __deepcopy__(self, memo: dict) -> FirstCallCheck:
        clone = copy.copy(self)
        clone.meta = copy.deepcopy(self.meta, memo)  # the copied model's meta where it is one
        return clone


def _problem(delegate: Delegate, compiled: nn.Module, reference: fx.GraphModule, inputs: tuple,
             regions: int) -> str:
    """Why a compiled partition breaks the contract ('' if it holds): its outputs, then its
    regions one by one where the outputs call for it (drift or a wrong region: one compile more
    tells them apart)."""
    problem, exact = _contract_problem(compiled, reference, inputs, regions)
    return problem or ("" if exact else _region_problem(delegate, reference, inputs))


def _recompiled(delegate: Delegate, reference: fx.GraphModule, inputs: tuple,
                regions: int) -> tuple[nn.Module | None, str]:
    """``reference`` compiled again and checked: (the module, why it still breaks the contract)."""
    try:
        module = delegate.compile(reference, inputs)
    except Exception as exc:  # noqa: BLE001 - reported as the partition's problem
        return None, f"compiling failed ({type(exc).__name__}: {exc})"
    return module, _problem(delegate, module, reference, inputs, regions)


def _outputs(value: object) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _contract_problem(compiled: nn.Module, reference: fx.GraphModule, inputs: tuple,
                      regions: int) -> tuple[str, bool]:
    """Why ``compiled`` breaks the contract against its reference form ('' if it holds), and
    whether its outputs also meet one kernel's element-wise contract.

    A single-region partition is held to one kernel's contract. A partition of several int8
    regions adds up their roundings, so element-wise steps say little about it (a deep one may
    agree region by region and still drift end to end on random weights): it must run and
    return outputs of the right number, shapes, dtypes and finite values that correlate with the
    reference's (cosine > 0: a sign flip or zeros is a wrong compile); where its outputs are not
    within one kernel's contract, its regions are checked one by one (:func:`_region_problem`).
    """
    with torch.no_grad():
        expected = _outputs(reference(*inputs))
        try:
            got = _outputs(compiled(*inputs))
        except Exception as error:  # noqa: BLE001 - a raising partition is a broken one
            return f"it raised {type(error).__name__}: {' '.join(str(error).split())[:160]}", False
    if len(got) != len(expected):
        return f"it returned {len(got)} outputs, expected {len(expected)}", False
    strict = True
    for i, (out, ref) in enumerate(zip(got, expected)):
        integer = isinstance(ref, torch.Tensor) and not ref.is_floating_point()
        scale, dtype = 1.0 if integer else None, getattr(ref, "dtype", None)
        problem = output_violation(out, ref, dtype, scale,
                                   max_outlier_fraction=MAX_OUTLIER_FRACTION if regions <= 1 else 1.0)
        if not problem and regions > 1 and isinstance(ref, torch.Tensor) and bool(ref.any()):
            cosine = float(torch.nn.functional.cosine_similarity(
                out.double().flatten(), ref.double().flatten(), dim=0))
            if not cosine > 0:  # not even pointing the same way: a wrong compile, not drift
                problem = f"its outputs point away from the reference's (cosine {cosine:.2f})"
        if problem:
            return (f"output {i}: {problem}" if len(expected) > 1 else problem), False
        strict = strict and (regions <= 1 or not output_violation(out, ref, dtype, scale))
    return "", strict


def _region_problem(delegate: Delegate, reference: fx.GraphModule, inputs: tuple) -> str:
    """Why one int8 region of a multi-region partition disagrees with its reference form ('' if
    none does): each region compiled alone by ``delegate`` on the reference's own inputs.

    A check-only module that does not compile or run says nothing about the partition (the
    partition itself passed the structural check): it is kept.
    """
    try:
        parity = layer_parity(reference, delegate.compile, inputs, steps=REGION_STEPS)
    except Exception:  # noqa: BLE001 - the check graph, not the partition, failed
        return ""
    if not parity.regions or parity.worst.within >= REGION_MIN_WITHIN:
        return ""
    worst = parity.worst
    return (f"int8 region {worst.name}, compiled alone on the reference's own inputs, is within "
            f"{REGION_STEPS} step of the reference on {worst.within:.1%} of its {worst.elements} "
            f"elements (needs {REGION_MIN_WITHIN:.0%}; up to {worst.max_steps} steps)")


def _delegate_label(backend_name: str) -> str:
    from qplug_core.registry import plugins

    result = plugins.collect_first("qplug_delegate", backend=backend_name)
    return f"plugin {result.record.label}" if result is not None else "an unregistered plugin"
