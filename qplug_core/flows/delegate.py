"""Delegation: a backend whose runtime compiles whole subgraphs (ONNX Runtime, an NPU SDK).

Instead of (or besides) per-op kernels, such a backend gives a
:class:`~qplug_core.registry.contract.Delegate` through the
``qplug_delegate`` hook: an ``OperatorSupportBase`` saying which nodes of the reference form it
takes, and a ``compile`` function turning one partition (a GraphModule in reference form, plus
example inputs) into one module. The core groups the supported nodes with
``CapabilityBasedPartitioner``, keeps only partitions holding int8 work, fuses each into a
submodule and swaps in the compiled module. The parameters, buffers and folded constants a
partition reads are read inside its submodule (``attributes_inside``), so the runtime gets them as
constants of its model (a ViT's class token and position table: initializers ORT can fold), not as
inputs fed at every call. Everything else stays in PyTorch (so do the ops reading
a model input that is not a tensor: :mod:`qplug_core.flows.python_inputs`), and the report lists
the partitions and every node left outside with the reason.

A compiled partition is checked like a lowered kernel (:mod:`qplug_core.flows.kernel_check`): run
on the inputs it saw when the reference form ran on the example inputs, each output must be
within the contract's steps of the reference partition's. A partition of several int8 regions
whose outputs are not within that contract (roundings drift through a deep partition, or one
region is wrong) is checked region by region (:mod:`qplug_core.flows.region_parity`: each region
compiled by the same compile function, side by side in one check-only module, fed the reference
partition's own integer inputs): each region's integers within one step of the reference's on
>= 99% of its elements. That costs one more compile, so only where the outputs call for it (its
ONNX model cut from the partition's where that was exported: ``onnx_export/region_models.py``). One
that fails either where the backend's kernels sum u8 x s8 pairs in int16 (ONNX Runtime's fused
U8S8 kernels on a CPU without VNNI under 8-bit weights) is compiled and checked once more with
7-bit weights (:mod:`qplug_core.flows.safer_weights`; a warning and the report's partition note
say so). Regions still found wrong one by one (an SDK wrong in one inner layer: OpenVINO on a
grouped conv1d of Wav2Vec2's feature encoder) stay in reference form and the partitions are
planned again without them, so the rest of the partition still runs compiled; a partition still
wrong as a whole keeps the reference form. Each comes with a warning naming the partition, the
region and the plugin, and the report says why. The partitions are fused into the model once
the plan holds. After ``qp.load`` the regions kept in reference form at convert are left out of
the partitions again, and each partition is compiled and checked at its first call, on its
first inputs (:class:`FirstCallCheck`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from qplug_core.errors import DelegateRuntimeError, PluginHookError, QplugError, first_line, warn_user
from qplug_core.flows.boundary_tuples import unpack_boundary_tuples
from qplug_core.flows.kernel_check import (
    CONTRACT_BROKEN,
    MAX_BIAS_STEPS,
    MAX_OUTLIER_FRACTION,
    ValueRecorder,
    as_outputs,
    bias_steps,
    biased,
    output_violation,
)
from qplug_core.flows.native_stderr import echo, native_stderr, raised
from qplug_core.flows.progress import Steps
from qplug_core.flows.python_inputs import python_input_readers
from qplug_core.flows.region_parity import layer_parity, region_of, reusing_exports
from qplug_core.flows.report import describe_op, float_compute_nodes, report_names
from qplug_core.flows.rounding_noise import MAX_NOISE_RATIO, rounding_noise
from qplug_core.flows.safer_weights import make_safer, may_saturate
from qplug_core.flows.shape_ints import recompute_boundary_ints
from qplug_core.flows.sparse_values import sparse_value_ops
from qplug_core.flows.tags import BOUNDARY, KERNEL, REPORT, region_tag
from qplug_core.flows.untouched_partition import compile_untouched
from qplug_core.kernels.held_int8 import int8_form
from qplug_core.partition import CapabilityBasedPartitioner, OperatorSupportBase, fuse_by_partitions
from qplug_core.partition.compiled import CompiledPartition, built_from
from qplug_core.partition.fuse import build_submodule
from qplug_core.partition.lazy import LazyPartition
from qplug_core.partition.served import ServedPartition, runs
from qplug_core.partition.sole import install as install_sole_call
from qplug_core.partition.stored_model import StoredPartition
from qplug_core.registry import plugins
from qplug_core.registry.contract import Delegate

if TYPE_CHECKING:
    from qplug_core.registry.plugins import PluginRecord

#: a region of a multi-region partition must agree with the reference within one integer step
#: (on ``region_parity.REGION_MIN_WITHIN`` of its elements, :meth:`RegionParity.problem`)
REGION_STEPS = 1
#: a multi-region partition's float outputs: error L2 norm relative to the reference's, where
#: the reference form's own rounding noise cannot be measured (``_scale_problem``)
MAX_RELATIVE_L2 = 0.2
#: partition -> the ONNX models a file stores for it
StoredModels = dict[str, StoredPartition]
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
    note: str = ""  # what was changed for it to keep the contract (safer weights), or left unchecked


@dataclass
class DelegationSummary:
    partitions: list[PartitionRecord] = field(default_factory=list)
    outside: dict[str, str] = field(default_factory=dict)  # node name -> why it stayed in PyTorch
    lowered: dict[str, str] = field(default_factory=dict)  # int8 anchor -> partition
    reference: dict[str, str] = field(default_factory=dict)  # int8 anchor left in reference form -> why
    #: partition submodule -> its reference form: the report looks inside for ops left in float
    graphs: dict[str, fx.GraphModule] = field(default_factory=dict)
    #: regions the check kept out of the partitions, by end node -> why (recorded for qp.load)
    kept_regions: dict[str, str] = field(default_factory=dict)


#: names an int8 anchor as the report does (``flows.report.report_names``)
_Namer = Callable[[fx.Node], str]


def _int8_anchors(nodes: Iterable[fx.Node], name: _Namer) -> list[str]:
    return [name(n) for n in nodes if (tag := region_tag(n)) is not None and tag.is_anchor and tag.quantized]


@dataclass
class _Verdict:
    """A compiled partition held to the contract: the module to use, what was changed for it to
    keep the contract (``note``), why the reference form is kept instead (``reason``, '' if not),
    and the int8 regions found wrong one by one (end node -> why it stays in reference form). The
    note also says when those regions could not be checked one by one."""

    module: nn.Module
    note: str = ""
    reason: str = ""
    wrong_regions: dict[str, str] = field(default_factory=dict)


class _Refusing(OperatorSupportBase):
    """The delegate's operator support minus the nodes reading a model input that is not a tensor
    (``flows/python_inputs.py``), those taking or making a sparse tensor (``flows/sparse_values.py``)
    and the nodes of int8 regions to keep in reference form (node -> why: :func:`_region_nodes`,
    :func:`_nodes_of_ends`)."""

    def __init__(self, inner: OperatorSupportBase, gm: fx.GraphModule, kept: dict[fx.Node, str], backend_name: str):
        self.inner, self.backend_name = inner, backend_name
        self.refused = {**python_input_readers(gm), **sparse_value_ops(gm), **kept}
        #: why the delegate's ``unsupported_reason`` raised, by node (said once, in one warning)
        self.reasons_failed: dict[str, str] = {}

    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        """The delegate's answer; one that raises is the plugin's error, not a core pass's (no
        plan can be made without it)."""
        if node in self.refused:
            return False
        try:
            return self.inner.is_node_supported(submodules, node)
        except QplugError:
            raise
        except Exception as error:
            record = _delegate_record(self.backend_name)
            raise PluginHookError(
                f"backend {self.backend_name!r}: the operator support of {_delegate_label(self.backend_name)} "
                f"raised in is_node_supported on node {node.name!r} ({type(error).__name__}: {error})",
                **(record.attribution() if record is not None else {})) from error

    def unsupported_reason(self, submodules, node: fx.Node) -> str | None:
        """Why a node stays outside. One the delegate's ``unsupported_reason`` raises on loses only
        the explanation (the node stays outside, as ``is_node_supported`` said): the report says
        it raised, and :meth:`warn_failed_reasons` names the plugin."""
        if self.refused.get(node):
            return self.refused[node]
        try:
            return self.inner.unsupported_reason(submodules, node)
        except Exception as error:  # noqa: BLE001 - an explanation must not fail the conversion
            self.reasons_failed[node.name] = why = f"its unsupported_reason raised {type(error).__name__}: {error}"
            return why

    def warn_failed_reasons(self) -> None:
        if self.reasons_failed:
            nodes = list(self.reasons_failed)
            warn_user(f"qplug: backend {self.backend_name!r}: the operator support of "
                      f"{_delegate_label(self.backend_name)} raised in unsupported_reason on {len(nodes)} node(s) "
                      f"({', '.join(map(repr, nodes[:5]))}{' and more' if len(nodes) > 5 else ''}; first: "
                      f"{self.reasons_failed[nodes[0]].removeprefix('its unsupported_reason raised ')}); they stay "
                      "in PyTorch, as its is_node_supported said, and the report's reason for each says it raised")


def _region_nodes(gm: fx.GraphModule, regions: dict[int, str]) -> dict[fx.Node, str]:
    """The nodes of the tagged int8 regions ``regions`` (region id -> why): their own nodes, the
    dequantize nodes reading their inputs and the quantize nodes writing their outputs, so the
    partitions around them exchange int8 values."""
    nodes: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        tag = region_tag(node)
        if tag is None or tag.region_id not in regions:
            continue
        why = regions[tag.region_id]
        nodes[node] = why
        for edge in (*node.all_input_nodes, *node.users):
            if BOUNDARY in edge.meta:
                nodes.setdefault(edge, why)
    return nodes


def _region_ids(gm: fx.GraphModule, anchors: dict[str, str], name: _Namer) -> dict[int, str]:
    """The region ids of the int8 ``anchors`` (report name -> why) in ``gm``."""
    return {tag.region_id: anchors[name(n)] for n in gm.graph.nodes
            if (tag := region_tag(n)) is not None and tag.is_anchor and name(n) in anchors}


def _nodes_of_ends(gm: fx.GraphModule, wrong: dict[str, str]) -> dict[fx.Node, str]:
    """The nodes of the int8 regions ending in the nodes ``wrong`` names (end node -> why), as the
    region check cut them (:func:`region_of`), with every tagged region among them whole. Not the
    tagged regions alone: the region ending in the quantize after a segment-mean ``scatter_reduce``
    holds float ops no pattern tagged, and refusing only its tagged ``unsqueeze`` planned the same
    wrong partition again, which was then kept whole in reference form."""
    nodes: dict[fx.Node, str] = {}
    for end in gm.graph.nodes:
        if end.name in wrong:
            why = wrong[end.name]
            _, members = region_of(gm, end)
            ids = {tag.region_id for n in members if (tag := region_tag(n)) is not None}
            nodes.update(_region_nodes(gm, dict.fromkeys(ids, why)))
            nodes.update((n, why) for n in members if n.op in _CALLS)
    return nodes


def _int8_partitions(gm: fx.GraphModule, support: _Refusing, delegate: Delegate,
                     backend_name: str, name: _Namer) -> tuple[list[list[fx.Node]], dict[str, str]]:
    """The partitions holding int8 work (nodes in graph order), and why each call node left
    outside stays in PyTorch."""
    submodules = dict(gm.named_modules())
    outside = {}
    for node in gm.graph.nodes:
        if node.op in _CALLS and not support.is_node_supported(submodules, node):
            reason = support.unsupported_reason(submodules, node)
            refused = node in support.refused
            outside[node.name] = reason if refused and reason else (
                f"backend {backend_name!r} does not take {describe_op(node, gm)}" + (f": {reason}" if reason else ""))
    partitioner = CapabilityBasedPartitioner(gm, support,
                                             allows_single_node_partition=delegate.allows_single_node_partition)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    partitions = []
    for partition in partitioner.propose_partitions():
        if _int8_anchors(partition.nodes, name):
            partitions.append(sorted(partition.nodes, key=order.__getitem__))
        else:
            outside.update({n.name: "in a partition without int8 work: left in PyTorch"
                            for n in partition.nodes if BOUNDARY not in n.meta})
    return partitions, outside


def _inputs_of(gm: fx.GraphModule, partitions: list[list[fx.Node]], example_inputs: tuple
               ) -> dict[fx.Node, Any]:
    """The values every partition reads, from one run of ``gm`` on the example inputs."""
    wanted = set()
    for nodes in partitions:
        members = set(nodes)
        wanted |= {a for n in nodes for a in n.all_input_nodes if a not in members}
    values: dict[fx.Node, Any] = {}
    with torch.no_grad():
        ValueRecorder(gm, wanted, values).run(*example_inputs)
    return values


def delegate_graph(gm: fx.GraphModule, delegate: Delegate, example_inputs: tuple | None,
                   backend_name: str, keep_reference: dict[str, str] | None = None,
                   arithmetic: Any = None, keep_regions: dict[str, str] | None = None,
                   stored: StoredModels | None = None, progress: bool | None = False) -> DelegationSummary:
    """Partition ``gm`` (reference form) for ``delegate`` and compile its int8 partitions, in place.

    ``example_inputs=None`` (``qp.load``): nothing runs now, each partition is compiled at its
    first call (:class:`~qplug_core.partition.lazy.LazyPartition`). ``keep_reference`` (int8
    anchor -> why, recorded at convert) names regions left in reference form then: they are
    left out of the partitions again, as are the regions ``keep_regions`` names (end node -> why:
    those the check below kept out then), and ``stored`` (partition -> the ONNX models ``qp.save``
    stored for it) is what each builds its first models from instead of exporting, where they
    pass :func:`~qplug_core.partition.stored_model.stored_model_problem`'s checks (a warning names
    a partition whose models do not: it is exported again). ``arithmetic``: how the backend's kernels sum products
    (``Backend.arithmetic``): a partition that breaks the contract where they sum pairs in int16
    is compiled once more with 7-bit weights (``flows/safer_weights.py``) before it is given up.

    A partition that breaks the contract in some of its int8 regions (found region by region)
    is planned again without those regions: they stay in reference form and the rest of it is
    compiled around them. A partition that fails as a whole (its compile, or a check that finds no
    region to blame) is planned again without its int8 regions too: ``qp.load`` plans without them
    from the start (``keep_reference``), and only the same plan at both ends lets load rebuild the
    partitions the file recorded (planned around the failed partition's nodes, a Wav2Vec2 on
    OpenVINO was grouped otherwise at load, which refused the file). The partitions are fused into
    ``gm`` once the plan holds. ``progress`` says each partition compiled and checked
    (:class:`~qplug_core.flows.progress.Steps`).
    """
    report_key = report_names(gm.graph)  # the report's names, taken before partitions are fused
    refused = {**_region_nodes(gm, _region_ids(gm, keep_reference or {}, report_key)),
               **_nodes_of_ends(gm, keep_regions or {})}
    verdicts: dict[frozenset[str], _Verdict] = {}  # by the names of a partition's nodes
    split: dict[fx.Node, str] = {}  # regions found wrong now, left out of the partitions around them
    kept_regions = dict(keep_regions or {})  # their end nodes, for the file
    with Steps(f"{backend_name}: compiling and checking partitions",
               progress if example_inputs is not None else False) as steps:
        while True:
            support = _Refusing(delegate.operator_support, gm, refused, backend_name)
            partitions, outside = _int8_partitions(gm, support, delegate, backend_name, report_key)
            partitions = unpack_boundary_tuples(gm, recompute_boundary_ints(gm, partitions))
            if example_inputs is None:
                break
            values = _inputs_of(gm, partitions, example_inputs)
            wrong: dict[fx.Node, str] = {}
            keys = [frozenset(n.name for n in nodes) for nodes in partitions]
            steps.add(len(set(keys) - verdicts.keys()))
            for i, (nodes, key) in enumerate(zip(partitions, keys)):
                if key not in verdicts:
                    verdicts[key] = _compiled(delegate, gm, nodes, values, f"{PREFIX}{i}", report_key, backend_name,
                                              arithmetic)
                    steps.done(f"partition {PREFIX}{i} ({len(nodes)} nodes)")
                wrong.update(_nodes_of_ends(gm, verdicts[key].wrong_regions))
                kept_regions.update(verdicts[key].wrong_regions)
                if verdicts[key].reason and not verdicts[key].wrong_regions:  # failed whole: planned again
                    # without its regions, as qp.load plans (from the record)
                    anchors = dict.fromkeys(_int8_anchors(nodes, report_key), verdicts[key].reason)
                    wrong.update(_region_nodes(gm, _region_ids(gm, anchors, report_key)))
            if not wrong.keys() - refused.keys():
                break
            split.update(wrong)
            refused.update(wrong)  # planned again without them; each round refuses another region
    for why in dict.fromkeys(split.values()):
        warn_user(f"qplug: backend {backend_name!r}: {why}")
    support.warn_failed_reasons()
    if example_inputs is not None:
        _warn_refused_layers(gm, outside, refused, report_key)
    summary = _fuse(gm, delegate, partitions, outside, verdicts, report_key, backend_name, arithmetic,
                    loading=example_inputs is None, stored=stored or {})
    summary.kept_regions = kept_regions
    return summary


def _warn_refused_layers(gm: fx.GraphModule, outside: dict[str, str], refused: dict[fx.Node, str],
                         name: _Namer) -> None:
    """Int8 layers the backend does not take (onnxruntime's LSTM with ``proj_size``) run in PyTorch
    in reference form: one warning at convert names them, as a kernel that refuses a layer is named,
    and counts them with those the check kept out (in ``refused``: named by warnings of their own)."""
    layers = [node for node in gm.graph.nodes
              if node.name in outside and node.op == "call_module" and (tag := region_tag(node)) is not None
              and tag.is_anchor and tag.quantized]
    new = [f"{name(node)!r} ({outside[node.name]})" for node in layers if node not in refused]
    named = [repr(name(node)) for node in layers if node in refused]
    if new:
        listed = "; ".join(new[:5]) + (f"; and {len(new) - 5} more" if len(new) > 5 else "")
        listed += f"; {', '.join(named)} (named above)" if named else ""
        warn_user(f"qplug: {len(layers)} int8 layer(s) run in PyTorch in reference form (int8 rounding "
                  f"simulated in float, slower than the backend's own): {listed}")


def _compiled(delegate: Delegate, gm: fx.GraphModule, nodes: list[fx.Node], values: dict[fx.Node, Any],
              name: str, report_key: _Namer, backend_name: str, arithmetic: Any) -> _Verdict:
    """``nodes`` compiled as one partition on the inputs the example gave them, and checked."""
    partition, inputs, _ = build_submodule(gm, nodes, name, attributes_inside=True)
    example = tuple(values[n] for n in inputs)
    with reusing_exports():  # its check graph is cut from the model its compile exported
        try:
            module = compile_untouched(delegate.compile, partition, example, _compiler(backend_name))
        except Exception as exc:  # one partition failing must not fail the conversion
            return _Verdict(partition, reason=f"compiling partition {name} failed ({type(exc).__name__}: {exc}); "
                                              "reference form kept")
        return _checked(delegate, module, partition, example, _int8_anchors(nodes, report_key), name,
                        backend_name, arithmetic, "on the example inputs")


def _fuse(gm: fx.GraphModule, delegate: Delegate, partitions: list[list[fx.Node]], outside: dict[str, str],
          verdicts: dict[frozenset[str], _Verdict], name: _Namer, backend_name: str, arithmetic: Any, *,
          loading: bool, stored: StoredModels) -> DelegationSummary:
    """Fuse the planned ``partitions`` into ``gm`` and swap in their compiled modules (their lazy
    ones when ``loading``, built from their ``stored`` models); the summary of what runs where."""
    summary = DelegationSummary(outside=dict(outside))
    members = [(nodes, _int8_anchors(nodes, name), verdicts.get(frozenset(n.name for n in nodes)))
               for nodes in partitions]
    fuse_by_partitions(gm, partitions, prefix=PREFIX, attributes_inside=True)
    for i, (nodes, anchors, verdict) in enumerate(members):
        partition_name = f"{PREFIX}{i}"
        partition_gm = gm.get_submodule(partition_name)
        summary.graphs[partition_name] = partition_gm
        if loading:  # compiled at the first call, checked where it may saturate
            module: nn.Module = LazyPartition(
                partition_gm, FirstCallCheck(gm.meta, delegate, partition_name, anchors, backend_name, arithmetic,
                                             _usable(stored.get(partition_name), partition_gm, partition_name,
                                                     backend_name)),
                name=partition_name, backend=backend_name)
        else:
            assert verdict is not None
            if verdict.reason:
                warn_user(f"qplug: backend {backend_name!r}: {verdict.reason}")
                summary.reference.update(dict.fromkeys(anchors, verdict.reason))
                continue
            if verdict.note:
                warn_user(f"qplug: backend {backend_name!r}: partition {partition_name} {verdict.note}")
            module = _served(verdict.module, partition_gm, gm.meta, delegate, partition_name, len(anchors),
                             backend_name)
        gm.set_submodule(partition_name, module)
        summary.partitions.append(PartitionRecord(partition_name, len(nodes), len(anchors), type(runs(module)).__name__,
                                                  "" if loading else verdict.note))
        summary.lowered.update(dict.fromkeys(anchors, partition_name))
    for node in gm.graph.nodes:
        if node.name in summary.outside and _int8_anchors([node], name):
            summary.reference[name(node)] = summary.outside[node.name]
    compiled = {p.name for p in summary.partitions}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in compiled:
            node.meta[KERNEL] = f"delegate:{backend_name}"
    gm.graph.lint()
    gm.recompile()
    _drop_taken_submodules(gm, summary.graphs.values())
    install_sole_call(gm)  # one partition: calls go straight to it (batch-1 overhead)
    return summary


def _usable(stored: StoredPartition | None, partition: fx.GraphModule, name: str, backend_name: str
            ) -> StoredPartition | None:
    """``stored`` if every one of its models passes the checks, else None (and a warning: the
    partition is exported again from its reference form at its first call); models of older files,
    fed the partition's attributes as inputs, take them as initializers first."""
    from qplug_core.partition.attribute_inputs import attribute_bytes, attributes_as_initializers
    from qplug_core.partition.stored_model import FILL_FACTOR, stored_model_problem

    if stored is None:
        return None
    models, room = [], FILL_FACTOR * attribute_bytes(partition)  # older models take them in: bounded in all
    for signature, source in stored.models:
        signature, built = attributes_as_initializers(source, signature, partition)
        room -= max(0, len(built) - len(source))
        problem = stored_model_problem(built, partition, signature) if room >= 0 else (
            f"its models take the partition's attributes in as initializers more than {FILL_FACTOR} times over")
        models.append((signature, built))
        if problem:
            warn_user(f"qplug: backend {backend_name!r}: the ONNX model the file stores for partition {name} is "
                      f"not used: {problem}; the partition is exported again from its reference form at its "
                      "first call (seconds; the file may be damaged or tampered with)")
            return None
    return replace(stored, models=models)


def _drop_taken_submodules(gm: fx.GraphModule, partitions: Iterable[fx.GraphModule]) -> None:
    """Delete from ``gm`` the submodules its partitions took: its own forward no longer calls them
    (a compiled partition, its reference form and the snapshot each keep the ones they run), and
    left in ``gm`` they showed its float weights in ``parameters()`` and ``state_dict()``."""
    used = {node.target for node in gm.graph.nodes if node.op in ("call_module", "get_attr")}
    taken = {node.target for partition in partitions for node in partition.graph.nodes
             if node.op in ("call_module", "get_attr")}
    for target in sorted(taken - used, key=len, reverse=True):
        if not any(str(u).startswith(f"{target}.") for u in used):
            gm.delete_submodule(str(target))


class NewSignatureContract:
    """The convert-time contract for the models a compiled partition builds later, for input
    signatures its models do not take (batch 1 after a batch-256 example): checked on the inputs
    that asked for them, as convert checks the first on the example inputs; a refused signature
    (also one whose compiled model raised on a call) is named in a warning and in the report's
    record of the partition. Inputs the reference form cannot take either are the caller's
    error: a :class:`DelegateRuntimeError` naming the plugin and the partition."""

    def __init__(self, meta: dict, delegate: Delegate, name: str, regions: int, backend_name: str):
        self.meta, self.delegate, self.name, self.regions = meta, delegate, name, regions
        self.backend_name = backend_name

    def problem(self, reference: fx.GraphModule, candidate: Callable[..., Any], inputs: tuple) -> str:
        """Why the model compiled for ``inputs`` breaks the contract on them ('' if it holds): its
        outputs, as convert checks them. Its int8 regions are not compiled one by one again: that
        check graph is a second export of the whole partition (of a first batch-4 call of an FPN
        detector on onnxruntime, 125 of 199 s on a loaded AMD EPYC Zen 4), the regions' arithmetic
        was checked at convert, and a new signature is the same graph at other sizes."""
        problem, _, off_scale = _contract_problem(candidate, reference, inputs, self.regions)
        problem = problem or off_scale
        return f"the model compiled for them {CONTRACT_BROKEN} ({problem})" if problem else ""

    def refused(self, signature: str, reason: str) -> None:
        warn_user(f"qplug: backend {self.backend_name!r}: partition {self.name} compiled by "
                  f"{_delegate_label(self.backend_name)} runs its reference form for inputs of {signature}: "
                  f"{reason}")
        report = self.meta.get(REPORT)
        for record in report.partitions if report is not None else ():
            if record["name"] == self.name:
                record.setdefault("reference_inputs", {})[signature] = reason

    def failed(self, signature: str, error: Exception, again: Exception) -> Exception:
        record = _delegate_record(self.backend_name)
        return DelegateRuntimeError(
            f"backend {self.backend_name!r}: partition {self.name} compiled by {_delegate_label(self.backend_name)} "
            f"raised {type(error).__name__}: {first_line(error)} on inputs of {signature}, and its reference form "
            f"cannot take them either ({type(again).__name__}: {first_line(again)}): the inputs do not fit the "
            "model (their shapes, dtypes or values)", backend=self.backend_name,
            plugin=record.name if record is not None else None, dist=record.dist if record is not None else None,
            partition=self.name)

    def __deepcopy__(self, memo: dict) -> NewSignatureContract:
        clone = copy.copy(self)
        clone.meta = copy.deepcopy(self.meta, memo)  # the copied model's meta where it is one
        return clone


def _served(module: nn.Module, reference: fx.GraphModule, meta: dict, delegate: Delegate, name: str, regions: int,
            backend_name: str) -> nn.Module:
    """``module`` as the model runs it, once held to the contract: the models it compiles for new
    input signatures held to it too, and a call it raises on answered by ``reference`` (its own
    reference form for a ``CompiledPartition``)."""
    check = NewSignatureContract(meta, delegate, name, regions, backend_name)
    if isinstance(module, CompiledPartition):
        module.signature_check = check
        return module
    return ServedPartition(module, reference, check)


def _checked(delegate: Delegate, module: nn.Module, reference: fx.GraphModule, inputs: tuple,
             anchors: list[str], name: str, backend_name: str, arithmetic: Any, on: str) -> _Verdict:
    """A compiled partition held to the contract ``on`` its ``inputs``.

    One that breaks it where int16 pair sums may be why is compiled again with 7-bit weights
    (changed in place on ``reference``'s modules, undone if that fails too)."""
    problem, wrong, unchecked = _problem(delegate, module, reference, inputs, len(anchors), backend_name)
    if not problem:
        return _Verdict(module, note=unchecked)
    safer = make_safer(reference, arithmetic)
    if safer is not None:
        again_module, again, wrong, unchecked = _recompiled(delegate, reference, inputs, len(anchors), backend_name)
        if not again and again_module is not None:
            return _Verdict(again_module, note=(
                f"compiled with 7-bit weights in {', '.join(safer.layers)}: with 8-bit ones it "
                f"{CONTRACT_BROKEN} ({problem}; this CPU's int8 kernels sum u8 x s8 pairs in int16)"
                + (f"; then {unchecked}" if unchecked else "")))
        safer.undo()
        problem += f"; with 7-bit weights too: {again}"
    broke = f"partition {name} compiled by {_delegate_label(backend_name)} {CONTRACT_BROKEN} {on} ({problem})"
    kept_alone = f"{broke}; this region is kept in reference form, the rest of the partition compiled without it"
    return _Verdict(module, reason=f"{broke}; reference form kept", wrong_regions=dict.fromkeys(wrong, kept_alone))


class FirstCallCheck:
    """A loaded partition's compile, checked on its first inputs as convert checks it on the
    example inputs, on every CPU: a compile at load is a new compile, often by another runtime
    version on another host, so convert's check says nothing about it. One that breaks the
    contract is given up for its reference form (where its kernels may saturate int16 pair sums,
    ``flows/safer_weights.may_saturate``, it is first made safer), and the model's report says so.
    The check costs one reference-form run per partition, at its first call (and the import of
    torch._dynamo its ops' first call brings: ~2 s, ~70 MiB). A partition that runs the models
    the file stores (those convert checked, on a CPU of the same VNNI) is checked only where its
    kernels may saturate int16 pair sums here, or where the file records another version of the
    runtime than the one building them here."""

    def __init__(self, meta: dict, delegate: Delegate, name: str, anchors: list[str],
                 backend_name: str, arithmetic: Any, stored: StoredPartition | None = None):
        self.meta, self.delegate, self.name, self.anchors = meta, delegate, name, anchors
        self.backend_name, self.arithmetic = backend_name, arithmetic
        self.stored = stored  # the models the file stores for it, built instead of exporting

    @torch.autocast("cpu", enabled=False)  # a first call under the caller's autocast: checked in float32
    def __call__(self, partition: fx.GraphModule, inputs: tuple) -> nn.Module:
        stored, self.stored = self.stored, None  # once: a compile made safer below exports its changed weights
        with reusing_exports():
            with built_from(stored.models if stored is not None else []):
                module = compile_untouched(self.delegate.compile, partition, inputs, _compiler(self.backend_name))
            if self._as_checked_at_save(module, partition, stored):
                return _served(module, partition, self.meta, self.delegate, self.name, len(self.anchors),
                               self.backend_name)
            verdict = _checked(self.delegate, module, partition, inputs, self.anchors, self.name,
                               self.backend_name, self.arithmetic, "on its first inputs after qp.load on this CPU")
        reason, note = verdict.reason, verdict.note
        if reason or note:
            warn_user(f"qplug: backend {self.backend_name!r}: "
                      + (reason or f"partition {self.name} {note}"))
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
        if verdict.module is not module and isinstance(verdict.module, CompiledPartition):  # weights changed: held anew
            verdict.module.hold(int8_form(partition, {}))
        return partition if reason else _served(verdict.module, partition, self.meta, self.delegate, self.name,
                                                len(self.anchors), self.backend_name)

    def _as_checked_at_save(self, module: nn.Module, partition: fx.GraphModule, stored: StoredPartition | None
                            ) -> bool:
        """Whether ``module`` runs the models the file stores as convert checked them: built from
        them by the runtime version that checked them (where the file records it), on a CPU whose
        int16 pair sums cannot saturate."""
        return (stored is not None and isinstance(module, CompiledPartition) and module.from_stored
                and stored.runtime in (None, module.runtime()) and not may_saturate(partition, self.arithmetic))

    def __deepcopy__(self, memo: dict) -> FirstCallCheck:
        clone = copy.copy(self)
        clone.meta = copy.deepcopy(self.meta, memo)  # the copied model's meta where it is one
        return clone


def _problem(delegate: Delegate, compiled: Callable[..., Any], reference: fx.GraphModule, inputs: tuple,
             regions: int, backend_name: str) -> tuple[str, dict[str, str], str]:
    """Why a compiled partition breaks the contract ('' if it holds), its int8 regions found
    wrong one by one (end node -> problem), and why those could not be checked ('' if they were):
    its outputs first, then its regions where the outputs call for it (drift or a wrong region:
    one compile more tells them apart)."""
    problem, exact, off_scale = _contract_problem(compiled, reference, inputs, regions)
    if problem or exact:
        return problem, {}, ""
    wrong, unchecked = _wrong_regions(delegate, reference, inputs, regions, backend_name)
    if wrong:
        return "; ".join(wrong.values()), wrong, unchecked
    return (f"{off_scale}; it {unchecked}" if off_scale and unchecked else off_scale), {}, unchecked


def _recompiled(delegate: Delegate, reference: fx.GraphModule, inputs: tuple,
                regions: int, backend_name: str) -> tuple[nn.Module | None, str, dict[str, str], str]:
    """``reference`` compiled again and checked: (the module, why it still breaks the contract,
    its regions found wrong, why they could not be checked)."""
    try:
        module = compile_untouched(delegate.compile, reference, inputs, _compiler(backend_name))
    except Exception as exc:  # noqa: BLE001 - reported as the partition's problem
        return None, f"compiling failed ({type(exc).__name__}: {exc})", {}, ""
    return module, *_problem(delegate, module, reference, inputs, regions, backend_name)


def _contract_problem(compiled: Callable[..., Any], reference: fx.GraphModule, inputs: tuple,
                      regions: int) -> tuple[str, bool, str]:
    """Why ``compiled`` breaks the contract against its reference form ('' if it holds), whether
    its outputs also meet one kernel's element-wise contract, and why its float outputs are off in
    scale ('' if not: :func:`_scale_problem`; a region found wrong one by one is the likelier
    cause, so it is asked for first).

    A single-region partition is held to one kernel's contract. A partition of several int8
    regions adds up their roundings, so element-wise steps say little about it (a deep one may
    agree region by region and still drift end to end on random weights): it must run and
    return outputs of the right number, shapes, dtypes and finite values that correlate with the
    reference's (cosine > 0: a sign flip or zeros is a wrong compile); where its outputs are not
    within one kernel's contract, or are off by more than MAX_BIAS_STEPS on average (a deep
    partition's drift can be biased, a region one step off on every element is too), its regions
    are checked one by one (:func:`_wrong_regions`), each held to the bias rule where it is sound.
    """
    with torch.no_grad():
        expected = as_outputs(reference(*inputs))
        with native_stderr() as printed:
            try:
                got = as_outputs(compiled(*inputs))
            except Exception as error:  # noqa: BLE001 - a raising partition is a broken one
                failure = error
            else:
                failure = None
    if failure is not None:
        return raised(failure, printed), False, ""
    echo(printed)
    if len(got) != len(expected):
        return f"it returned {len(got)} outputs, expected {len(expected)}", False, ""
    strict, off_scale, noise = True, "", None
    for i, (out, ref) in enumerate(zip(got, expected)):
        integer = isinstance(ref, torch.Tensor) and not ref.is_floating_point()
        scale, dtype = 1.0 if integer else None, getattr(ref, "dtype", None)
        problem = output_violation(out, ref, dtype, scale,
                                   max_outlier_fraction=MAX_OUTLIER_FRACTION if regions <= 1 else 1.0)
        # a deep partition's outputs drift, biased too (ORT on the zoo's MobileNetV2: +0.82 steps
        # on average, right region by region): a biased one is judged region by region
        off_average = abs(bias := bias_steps(out, ref, scale)) > MAX_BIAS_STEPS
        loose = regions > 1 and bool(output_violation(out, ref, dtype, scale))
        if not problem and regions > 1 and isinstance(ref, torch.Tensor) and bool(ref.any()):
            cosine = float(torch.nn.functional.cosine_similarity(
                out.double().flatten(), ref.double().flatten(), dim=0))
            if not cosine > 0:  # not even pointing the same way: a wrong compile, not drift
                problem = f"its outputs point away from the reference's (cosine {cosine:.2f})"
            elif loose and not off_scale:
                noise = rounding_noise(reference, inputs, expected) if noise is None else noise
                if off := _scale_problem(out, ref, noise[i]):
                    off_scale = f"output {i}: {off}" if len(expected) > 1 else off
        if not problem and regions <= 1 and off_average:
            problem = f"its outputs are {biased(bias)}"
        if problem:
            return (f"output {i}: {problem}" if len(expected) > 1 else problem), False, ""
        strict = strict and not loose and not off_average
    return "", strict and not off_scale, off_scale


def _scale_problem(out: torch.Tensor, ref: torch.Tensor, noise: float | None) -> str:
    """Why a multi-region partition's float output is off ('' if not): its error's L2 norm beyond
    ``MAX_NOISE_RATIO`` times the reference form's own activation-rounding noise on it
    (``noise``; where unknown, beyond ``MAX_RELATIVE_L2`` of the reference's norm). Its regions,
    checked one by one, compare integer codes, never the float a trailing Dequantize makes, and
    each compiled alone may be right where the whole is not (OpenVINO's Concat in a UNet with
    symbolic sizes: 33 dB vs float, its reference form 53 dB), so nothing else finds these."""
    if not ref.is_floating_point():
        return ""
    error = float((out.double() - ref.double()).norm())
    if not noise:  # unknown, or none to measure (activations quantized at run time: dynamic linears)
        relative = error / float(ref.double().norm())
        return (f"its outputs are off by {relative:.1%} of the reference's L2 norm (at most {MAX_RELATIVE_L2:.0%}: "
                "a wrong output scale, not rounding drift)") if relative > MAX_RELATIVE_L2 else ""
    if error <= MAX_NOISE_RATIO * noise:
        return ""
    return (f"its outputs are off by {error / noise:.1f}x the reference form's own activation-rounding "
            f"noise (L2 {error:.3g} vs {noise:.3g}, at most {MAX_NOISE_RATIO:g}x: "
            f"{_sqnr(ref, error):.1f} dB vs the reference form, which is {_sqnr(ref, noise):.1f} dB from "
            "its unrounded self; not rounding drift)")


def _sqnr(ref: torch.Tensor, error: float) -> float:
    return 10 * math.log10(float(ref.double().norm()) ** 2 / max(error, 1e-30) ** 2)


def _wrong_regions(delegate: Delegate, reference: fx.GraphModule, inputs: tuple,
                   regions: int, backend_name: str) -> tuple[dict[str, str], str]:
    """The int8 regions of a multi-region partition that disagree with their reference form (end
    node -> why), each compiled alone by ``delegate`` on the reference's own inputs; and why they
    could not be checked ('' if they were).

    A check-only module that does not compile or run says nothing about the partition (the
    partition itself passed the structural check): it is kept, with a note that says so. Its
    modules are the model's, so it is compiled untouched as the partitions are.
    """
    def compile(check: fx.GraphModule, example: tuple) -> nn.Module:
        return compile_untouched(delegate.compile, check, example, _compiler(backend_name))

    try:
        parity = layer_parity(reference, compile, inputs, steps=REGION_STEPS)
    except Exception as error:  # noqa: BLE001 - the check graph, not the partition, failed
        return {}, (f"was checked as a whole only: its {regions} int8 regions could not be checked one by "
                    f"one ({type(error).__name__}: {first_line(error)})")
    return parity.problems, ""


def _delegate_record(backend_name: str) -> PluginRecord | None:
    result = plugins.collect_first("qplug_delegate", backend=backend_name)
    return result.record if result is not None else None


def _delegate_label(backend_name: str) -> str:
    record = _delegate_record(backend_name)
    return f"plugin {record.label}" if record is not None else "an unregistered plugin"


def _compiler(backend_name: str) -> str:
    """The delegate's compiler as messages name it."""
    return f"backend {backend_name!r} ({_delegate_label(backend_name)})"
