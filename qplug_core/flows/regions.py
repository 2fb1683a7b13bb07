"""Decide which matched patterns become int8 regions, and with which dtype config.

A *region* is one match of a backend quantization pattern. Two kinds are told apart:

* **anchors** carry weights (conv, linear, embedding, rnn): they are where int8 pays off, so they are
  quantized whenever the user's qconfig and the backend's dtype configs agree;
* **connectors** (add, cat, pooling, shape ops, norms, activations...) are quantized only when they
  sit *between* int8 regions: an int8 value reaches them, and their output reaches an int8 region.
  Quantizing a connector on its own adds error and saves nothing — this is what collapses
  transformer encoders under torch.ao's defaults (the attention-mask add of -10000, softmax and
  layer norm quantized between float matmuls). Pass ``keep_isolated_ops_float=False`` to quantize
  every matched op the qconfig allows, as torch.ao does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from qplug_core.config import DTypeConfig, ObservationType, QConfig, QConfigMapping
from qplug_core.config.defaults import FLOAT_IN_STATIC, FLOAT_IN_STATIC_REASON, grouped_transpose_qconfig
from qplug_core.errors import ConfigValidationError, ConstraintViolationError, spelled, warn_user
from qplug_core.flows.checks import mapping_qconfigs
from qplug_core.flows.exact_share import inexact_share_reason
from qplug_core.flows.report import NO_PATTERN
from qplug_core.flows.split_pieces import is_split, split_of
from qplug_core.flows.tags import CALLED_AS, LAYOUT, VALUE_KIND
from qplug_core.ir import module_stack
from qplug_core.kernels.reference import weight_of
from qplug_core.matcher import Match, find_matches
from qplug_core.patterns import format_pattern
from qplug_core.qparams import STORAGE_DTYPE

QUANTIZED_DTYPES = tuple(STORAGE_DTYPE)  # quint8, qint8, qint32
NOT_REQUESTED = "qconfig is None for this op (not requested)"


@dataclass(eq=False)
class Region:
    """One matched pattern and what prepare decided about it."""

    match: Match
    config: Any  # BackendPatternConfig
    qconfig: QConfig | None = None
    dtype_config: DTypeConfig | None = None
    weighted: bool = False
    quantized: bool = False
    reason: str = ""
    inputs: list[fx.Node] = field(default_factory=list)
    #: a weighted op whose output no int8 op reads, on a backend that fuses its dequantization
    float_output: bool = False

    @property
    def anchor(self) -> fx.Node:
        return self.match.anchor

    @property
    def root(self) -> fx.Node:
        getter = self.config.root_node_getter
        return getter(self.match.node_pattern) if getter else self.match.root

    @property
    def observation_type(self) -> ObservationType:
        return self.config.observation_type

    @property
    def is_dynamic(self) -> bool:
        return bool(self.dtype_config is not None and self.dtype_config.is_dynamic)

    @property
    def quantizes_output(self) -> bool:
        dc = self.dtype_config
        return (self.quantized and not self.is_dynamic and not self.float_output and dc is not None
                and dc.output_dtype in QUANTIZED_DTYPES
                and self.observation_type != ObservationType.INPUT_OUTPUT_NOT_OBSERVED)

    @property
    def pattern_name(self) -> str:
        return format_pattern(self.match.pattern)


def weight_name_of(module: nn.Module) -> str | None:
    """The dotted name of the weight int8 kernels quantize, or None for unweighted modules."""
    if isinstance(module, nn.Sequential) and len(module) and hasattr(module[0], "weight"):
        return "0.weight" if _is_matrix(module[0].weight) else None
    weight = getattr(module, "weight", None)
    return "weight" if _is_matrix(weight) else None


def weighted_kind(module: nn.Module) -> str | None:
    """The kind of int8 weighted op ``module`` (or the float module a reference-form wrapper
    holds) runs, as ``BackendSpec.float_outputs`` names it: ``"linear"`` for a 2-D weight (a
    matmul), ``"conv"`` for more dimensions; None for embeddings and unweighted modules."""
    module = getattr(module, "module", module)  # ReferenceWeighted wraps the float module
    name = None if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) else weight_name_of(module)
    if name is None:
        return None
    return "linear" if weight_of(module, name).dim() == 2 else "conv"


def _is_matrix(weight: Any) -> bool:
    return isinstance(weight, torch.Tensor) and weight.dim() >= 2


def _is_weighted(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op != "call_module":
        return False
    module = modules[node.target]
    return weight_name_of(module) is not None or isinstance(module, (nn.RNNBase, nn.RNNCellBase))


class CallCounter:
    """Counts calls of one object type per module, for ``set_module_name_object_type_order``."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, Any], int] = {}

    def next(self, scope: str, object_type: Any) -> int:
        index = self._counts.get((scope, object_type), 0)
        self._counts[(scope, object_type)] = index + 1
        return index


def resolve_qconfig(mapping: QConfigMapping, node: fx.Node, modules: dict[str, nn.Module],
                    counter: CallCounter) -> QConfig | None:
    """The qconfig of a region's root node, with torch.ao's lookup rules per node kind.

    Fused modules resolve as their weighted child (users write rules for ``nn.Conv2d``, not for
    ``ConvReLU2d``) unless the mapping names the fused type itself.
    """
    if node.op == "call_module":
        module = modules[node.target]
        object_type = type(module)
        if (isinstance(module, nn.Sequential) and len(module)
                and object_type not in mapping.object_type_qconfigs):
            object_type = type(module[0])
        # a shared module's later call: the path the user wrote, unless a rule names this call's copy
        # (qp.sensitivity and targets switch one call of a shared layer)
        path = node.target if node.target in mapping.module_name_qconfigs else node.meta.get(CALLED_AS, node.target)
        parent = path.rpartition(".")[0]
        return mapping.qconfig_for_module(path, object_type, counter.next(parent, object_type))
    scope_path, scope_type = module_stack.innermost(node)
    scope_type = module_stack.resolve_type(scope_type, mapping.object_type_qconfigs)
    if node.op == "call_function":
        index = counter.next(scope_path, node.target)
        return mapping.qconfig_for_function(node.target, scope_path, scope_type, index)
    return mapping.qconfig_for_method(node.target, scope_path, scope_type)


def observer_traits(obs: nn.Module) -> dict[str, Any]:
    """dtype, quant range, eps and dynamic flag of an observer or fake-quant module."""
    inner = getattr(obs, "activation_post_process", obs)
    eps = getattr(inner, "eps", None)
    return {
        "dtype": getattr(obs, "dtype", None),
        "quant_min": getattr(obs, "quant_min", None),
        "quant_max": getattr(obs, "quant_max", None),
        "eps": float(eps) if eps is not None else None,
        "is_dynamic": bool(getattr(obs, "is_dynamic", False)),
    }


def dtype_config_problems(qconfig: QConfig, dtype_config: DTypeConfig, weighted: bool) -> list[str]:
    """Why ``qconfig`` cannot run under ``dtype_config`` (empty when it can)."""
    act = observer_traits(qconfig.activation())
    problems = []
    if bool(dtype_config.is_dynamic) != act["is_dynamic"]:
        kind = "dynamic" if dtype_config.is_dynamic else "static"
        problems.append(f"the backend runs this op {kind}, the qconfig's activation is "
                        f"{'dynamic' if act['is_dynamic'] else 'static'}")
    if dtype_config.input_dtype is not None and dtype_config.input_dtype in QUANTIZED_DTYPES:
        exact = dtype_config.input_dtype_with_constraints.scale_exact_match is not None
        problems += [f"activation: {r}" for r in dtype_config.input_dtype_with_constraints.violations(
            act["dtype"], act["quant_min"], act["quant_max"], eps=act["eps"],
            scale=dtype_config.input_dtype_with_constraints.scale_exact_match if exact else None,
            zero_point=dtype_config.input_dtype_with_constraints.zero_point_exact_match if exact else None)]
    elif dtype_config.input_dtype is not None and act["dtype"] != dtype_config.input_dtype:
        problems.append(f"activation dtype {act['dtype']} is not the backend's {dtype_config.input_dtype}")
    if weighted and dtype_config.weight_dtype is not None:
        if qconfig.weight is None:
            problems.append("the qconfig has no weight observer")
        else:
            w = observer_traits(qconfig.weight())
            problems += [f"weight: {r}" for r in dtype_config.weight_dtype_with_constraints.violations(
                w["dtype"], w["quant_min"], w["quant_max"], eps=w["eps"])]
    return problems


class RegionPlanner:
    """Matches a backend's quantization patterns and decides every region's fate."""

    def __init__(self, gm: fx.GraphModule, backend, qconfig_mapping: QConfigMapping, *,
                 keep_isolated_ops_float: bool = True, on_unsupported: str = "warn",
                 backend_defaults: bool = False):
        self.gm = gm
        self.backend = backend
        self.mapping = qconfig_mapping
        #: the mapping is the backend's default one, so its per-layer meaning applies
        #: (``grouped_transpose_qconfig``); a user's own qconfig is taken as written
        self.backend_defaults = backend_defaults
        self.keep_isolated_ops_float = keep_isolated_ops_float
        self.on_unsupported = on_unsupported
        self.modules = dict(gm.named_modules(remove_duplicate=False))
        # (qconfig, dtype config, weighted) -> problems: checking builds throw-away observers,
        # and a model has few distinct qconfigs but thousands of regions. Keyed by id: hashing a
        # qconfig hashes the repr of its factories' arguments (~10 us, twice per region); the
        # regions keep their qconfigs alive, so an id is never reused while the plan runs
        self._problems: dict[tuple[int, int, bool], list[str]] = {}
        self._weight_axes: dict[int, int | None] = {}  # same reason: one observer per qconfig
        self._dynamic: bool | None = None  # whether the mapping quantizes dynamically, once asked

    def plan(self) -> list[Region]:
        configs = self.backend.config.pattern_to_config()
        matches = find_matches(self.gm, configs, modules=self.modules)
        regions: list[Region] = []
        seen: set[int] = set()
        counter = CallCounter()
        for node in self.gm.graph.nodes:
            match = matches.get(node.name)
            if match is None or match.anchor is not node or id(match) in seen:
                continue
            seen.add(id(match))
            region = Region(match, match.config)
            region.inputs = self._external_inputs(match)
            region.qconfig = resolve_qconfig(self.mapping, region.root, self.modules, counter)
            region.weighted = _is_weighted(region.root, self.modules)
            if region.weighted and region.qconfig is not None and self.backend_defaults:
                region.qconfig = grouped_transpose_qconfig(region.qconfig, self.modules[region.root.target])
            if region.weighted and region.qconfig is not None:
                self._check_weight_axis(region.qconfig, region.root)
            self._choose_dtype_config(region)
            regions.append(region)
        if self.keep_isolated_ops_float:
            _keep_isolated_connectors_float(self.gm, regions)
        if self.backend.float_outputs:
            _keep_unread_outputs_float(regions, self.modules, self.backend.float_outputs)
        if self.on_unsupported != "skip":
            _warn_mostly_float(self.gm, self.modules, regions)
        return regions

    def _external_inputs(self, match: Match) -> list[fx.Node]:
        members = set(match.nodes)
        inputs: list[fx.Node] = []
        for member in match.nodes:
            split = split_of(member)  # a piece shares the observer of the tensor cut into pieces
            for arg in split.all_input_nodes if split is not None else member.all_input_nodes:
                if arg not in members and arg not in inputs and _is_float_tensor(arg):
                    inputs.append(arg)
        return inputs

    def _choose_dtype_config(self, region: Region) -> None:
        if region.qconfig is None:
            region.reason = self._why_not_requested(region)
            return
        if region.observation_type == ObservationType.INPUT_OUTPUT_NOT_OBSERVED:
            region.reason = "op works on any dtype; nothing to observe"
            return
        pieces = is_split(region.anchor) and bool(region.inputs)  # a tuple of float tensors
        if not region.weighted and not _is_float_tensor(region.anchor) and not pieces:  # x.size(1) + 0
            region.reason = (f"its output is not a float tensor "
                             f"({region.anchor.meta.get(VALUE_KIND)}), so there is nothing to quantize")
            return
        sparse = next((n for n in (region.anchor, *region.inputs) if LAYOUT in n.meta), None)
        if sparse is not None:  # torch.mm(adjacency, x) in a GNN: observers cannot take its min/max
            region.reason = (f"{sparse.name!r} is a {sparse.meta[LAYOUT].removeprefix('torch.')} tensor; "
                             "int8 kernels take strided (dense) tensors only")
            return
        if region.observation_type == ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT:
            inexact = inexact_share_reason(region.anchor, self.modules)
            if inexact is not None:
                region.reason = inexact
                return
        problems_by_config = []
        for dtype_config in region.config.dtype_configs:
            key = (id(region.qconfig), id(dtype_config), region.weighted)
            problems = self._problems.get(key)
            if problems is None:
                problems = self._problems[key] = dtype_config_problems(
                    region.qconfig, dtype_config, region.weighted)
            if not problems:
                region.dtype_config = dtype_config
                region.quantized = True
                return
            problems_by_config.append(problems)
        if not problems_by_config:
            region.reason = f"the backend has no int8 kernel for {region.pattern_name}"
            if region.weighted:  # a layer asked for int8 that stays float says so
                self._unsupported(region, f"{region.pattern_name} at node {region.anchor.name!r} stays float: "
                                          f"{region.reason}. Leave it out of the qconfig mapping (set it to "
                                          "None) or use a backend that quantizes it.")
            return
        reason = "; ".join(problems_by_config[0])
        region.reason = f"the backend cannot honour the qconfig: {reason}"
        self._unsupported(region, f"{region.pattern_name} at node {region.anchor.name!r} stays float: "
                                  f"{region.reason}. Use the backend's default qconfig mapping "
                                  "(qp.get_default_qconfig_mapping) or adjust the qconfig for this op.")

    def _unsupported(self, region: Region, message: str) -> None:
        """A requested op stays float: raise, warn or say nothing, as ``on_unsupported`` asks."""
        if self.on_unsupported == "raise":
            raise ConstraintViolationError(message, field=region.anchor.name)
        if self.on_unsupported == "warn":
            warn_user(message)

    def _why_not_requested(self, region: Region) -> str:
        """The report's reason for an op whose qconfig is None: the backend's defaults set it so for a
        reason (no int8 kernel, or kernels for dynamic quantization only), which the user should read."""
        kinds = {bool(dtype_config.is_dynamic) for dtype_config in region.config.dtype_configs}
        if not kinds:
            return f"the backend has no int8 kernel for {region.pattern_name}"
        if kinds == {True} and not self._mapping_is_dynamic():
            return (f"{region.pattern_name} has int8 kernels for dynamic quantization only: "
                    "qp.quantize_dynamic quantizes it")
        if self._op_of(region.root) in FLOAT_IN_STATIC and not self._mapping_is_dynamic():
            return FLOAT_IN_STATIC_REASON
        return NOT_REQUESTED

    def _op_of(self, node: fx.Node) -> Any:
        """The module type or function a node calls, as qconfig mappings name ops."""
        return type(self.modules[str(node.target)]) if node.op == "call_module" else node.target

    def _mapping_is_dynamic(self) -> bool:
        if self._dynamic is None:
            self._dynamic = any(observer_traits(qconfig.activation())["is_dynamic"]
                                for qconfig in mapping_qconfigs(self.mapping))
        return self._dynamic

    def _check_weight_axis(self, qconfig: QConfig, root: fx.Node) -> None:
        """A per-channel weight axis must exist on this layer's weight; say so at prepare, by name."""
        if id(qconfig) not in self._weight_axes:
            observer = qconfig.weight() if qconfig.weight is not None else None
            self._weight_axes[id(qconfig)] = getattr(observer, "ch_axis", None)
        axis = self._weight_axes[id(qconfig)]
        name = weight_name_of(self.modules[root.target])
        if axis is not None and name is not None:
            _check_axis(axis, root.target, weight_of(self.modules[root.target], name))


def _check_axis(axis: int, layer: str, weight: torch.Tensor) -> None:
    if not -weight.dim() <= axis < weight.dim():
        raise ConfigValidationError(
            f"layer {layer!r}: the weight observer's ch_axis={axis} is out of range for its "
            f"{weight.dim()}-d weight of shape {tuple(weight.shape)}; use ch_axis=0 (output "
            "channels) or a per-tensor weight observer", field=f"{layer}.weight", value=axis)


def _warn_mostly_float(gm: fx.GraphModule, modules: dict[str, nn.Module], regions: list[Region]) -> None:
    """One warning when layers the backend keeps float (RNNs in static mode, a layer with no int8
    kernel or no pattern on this backend: openvino's LSTM) hold most of the model's weights: the
    "int8" model is then mostly the float one. Layers the user left out, and embedding lookups
    (half a small BERT's weights, no compute), are not counted."""
    kept = {str(r.root.target): r.reason for r in regions
            if r.weighted and r.qconfig is None and r.reason not in (NOT_REQUESTED, FLOAT_IN_STATIC_REASON)}
    matched = {node for r in regions for node in r.match.nodes}
    kept.update({str(node.target): NO_PATTERN for node in gm.graph.nodes  # lookups are no compute: not counted
                 if node.op == "call_module" and node not in matched
                 and not isinstance(modules[str(node.target)], (nn.Embedding, nn.EmbeddingBag))
                 and any(True for _ in modules[str(node.target)].parameters(recurse=False))})
    total = sum(p.numel() for p in gm.parameters())
    float_share = sum(p.numel() for name in kept for p in modules[name].parameters()) / max(total, 1)
    if float_share > 0.5:
        layers = ", ".join(f"{name!r} ({reason})" for name, reason in kept.items())
        warn_user(f"qplug: {float_share:.1%} of the model's weights stay float: {layers}")


def _is_float_tensor(node: fx.Node) -> bool:
    """Whether a node's value is a float tensor (recorded by ValueAnnotator; unknown counts as yes)."""
    return node.meta.get(VALUE_KIND, "float_tensor") == "float_tensor"


def _keep_isolated_connectors_float(gm: fx.GraphModule, regions: list[Region]) -> None:
    """Unquantize connectors that do not sit between int8 regions (see module docstring)."""
    region_of = {n: r for r in regions for n in r.match.nodes}
    connectors = [r for r in regions if r.quantized and not r.weighted]
    if not connectors:
        return

    def int8_in(region: Region) -> bool:
        return region.quantized and (region.weighted or region_id_up.get(id(region), False))

    region_id_up: dict[int, bool] = {}
    for region in regions:  # graph order: producers first
        if region.weighted or not region.quantized:
            continue
        region_id_up[id(region)] = any(
            (src := region_of.get(arg)) is not None and src is not region and int8_in(src)
            for arg in region.inputs)

    region_id_down: dict[int, bool] = {}

    def int8_out(region: Region) -> bool:
        return region.quantized and (region.weighted or region_id_down.get(id(region), False))

    for region in reversed(regions):  # consumers first
        if region.weighted or not region.quantized:
            continue
        region_id_down[id(region)] = any(
            (dst := region_of.get(user)) is not None and dst is not region and int8_out(dst)
            for user in region.anchor.users)

    for region in connectors:
        up, down = region_id_up.get(id(region)), region_id_down.get(id(region))
        if up and down:
            continue
        region.quantized = False
        side = "no int8 value reaches it" if not up else "its output feeds no int8 op"
        region.reason = (f"kept float: {side}; quantizing it alone would add error without a speed-up"
                         + spelled(" (keep_isolated_ops_float=False quantizes it anyway)", ""))


def _keep_unread_outputs_float(regions: list[Region], modules: dict[str, nn.Module], kinds: frozenset[str]
                               ) -> None:
    """Leave float the output of each static weighted region of one of ``kinds`` that no static
    int8 region reads (only float ops, dynamic regions or the model's output): the backend's op
    dequantizes into it, and a per-tensor grid there would only lose resolution."""
    region_of = {n: r for r in regions for n in r.match.nodes}
    for region in regions:
        if not (region.weighted and region.quantizes_output and weighted_kind(modules[region.root.target]) in kinds):
            continue
        readers = [region_of.get(user) for user in region.anchor.users]
        if not any(reader is not None and reader is not region and reader.quantized and not reader.is_dynamic
                   for reader in readers):
            region.float_output = True
