"""Prepare: insert observers (or fake-quant) where int8 regions need qparams.

Observation is per *value*: a tensor gets at most one observer, created by the first region that
needs it and reused by every other (never observing the same tensor twice, which is what makes
torch.ao's prepare superlinear). A region's output observer takes over every use of the output,
because the op's real output will be int8; an input observer on a float value only feeds the
int8 regions that asked for it, so float consumers keep the exact float value.
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from qplug_core.config import ObservationType
from qplug_core.flows.clamps import clamp_bounds, foldable_clamp
from qplug_core.flows.observer_copies import ObserverCopies
from qplug_core.flows.regions import QUANTIZED_DTYPES, Region
from qplug_core.flows.split_pieces import is_split
from qplug_core.flows.tags import FOLDED_CLAMP, OBSERVER, REGION, ROOT, VALUE_KIND, RegionTag
from qplug_core.observers import (
    FakeQuantize,
    FixedQParamsFakeQuantize,
    FixedQParamsObserver,
    ObserverBase,
)

OBSERVER_PREFIX = "activation_post_process_"


class ObserverInserter:
    """Inserts the observers a list of planned regions needs into ``gm`` (in place)."""

    def __init__(self, gm: fx.GraphModule, *, is_qat: bool):
        self.gm = gm
        self.is_qat = is_qat
        self.observer_of: dict[fx.Node, fx.Node] = {}
        # a dynamic region must not reuse a static observer of the same value (nor the reverse):
        # its kernel quantizes at run time and has no calibrated output scale
        self.dynamic_observer_of: dict[fx.Node, fx.Node] = {}
        # value -> the output observer that took over its every use (its consumers read that)
        self.standing_for: dict[fx.Node, fx.Node] = {}
        self.count = 0
        self.build = ObserverCopies()  # each observer equal to calling its factory, cheaper

    def insert(self, regions: list[Region]) -> None:
        region_of = {node: region for region in regions for node in region.match.nodes}
        modules = dict(self.gm.named_modules(remove_duplicate=False))
        for region in regions:
            if region.quantized:
                clamp = foldable_clamp(region, region_of, modules)
                self._observe_region(region, clamp, modules)
                if clamp is not None:  # also when left float for its float reader: it is folded
                    region_of[clamp].reason = "folded into its producer's output range (see qplug_core.flows.clamps)"

    def _observe_region(self, region: Region, clamp: fx.Node | None, modules: dict[str, nn.Module]
                        ) -> None:
        if FOLDED_CLAMP in region.anchor.meta:
            return
        if region.observation_type == ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT:
            self._share_input_observer(region)
            return
        if _observes_inputs(region):
            for value in region.inputs:
                read = self._read_by_consumers(value)
                observer = self._input_observer(region, value, read)
                for member in region.match.nodes:
                    member.replace_input_with(read, observer)
        if clamp is not None:  # observe the clamped value: the clamp becomes the output range
            clamp.meta[FOLDED_CLAMP] = clamp_bounds(clamp, modules)
            self._new_observer(clamp, self._output_observer(region), "output", reroute=True)
        elif region.quantizes_output:
            self._new_observer(region.anchor, self._output_observer(region), "output", reroute=True)

    def _read_by_consumers(self, value: fx.Node) -> fx.Node:
        """The node a consumer of ``value`` now reads: the output observer that took over every
        use of ``value`` (a static int8 producer's), else ``value`` itself."""
        return self.standing_for.get(value, value)

    def _input_observer(self, region: Region, value: fx.Node, read: fx.Node) -> fx.Node:
        """The observer ``region`` reads for its input ``value`` (``read``: what it reads now).

        A static region shares the value's one static observer. A dynamic region observes what
        it reads: behind a static producer that is the producer's output observer (the int8
        output, dequantized), so the dynamic observer sits after it and the region reads it."""
        if region.is_dynamic:
            return self.dynamic_observer_of.get(read) or self._new_observer(
                read, self.build(region.qconfig.activation), "input", reroute=False, dynamic=True)
        return self.observer_of.get(value) or self._new_observer(
            value, self.build(region.qconfig.activation), "input", reroute=False)

    def _share_input_observer(self, region: Region) -> None:
        """The region reads its first observed input's observer and writes through it. Another
        input that is float here (a ``cat`` of an int8 and a float value, in either order) is
        observed too, by its own observer if it has one, else by the shared one (as torch.ao
        does): the int8 op takes only quantized operands, and a float one was dropped."""
        source = next((value for value in region.inputs if value in self.observer_of), None)
        if source is None:
            region.quantized = False
            region.reason = "shares its input's qparams, but its input is float"
            return
        observer = self.observer_of[source]
        reads = {source: observer}
        for value in region.inputs:
            if value in reads:
                continue
            read = self._read_by_consumers(value)
            reads[value] = read if read is not value else self.observer_of.get(value) or \
                self._add_observer_node(value, observer.target, "shared", reroute=False)
        for member in region.match.nodes:
            for value, read in reads.items():
                member.replace_input_with(value, read)
        if not is_split(region.anchor):  # a tuple of pieces: each piece read shares it instead
            self._add_observer_node(region.anchor, observer.target, "shared", reroute=True)

    def _output_observer(self, region: Region) -> nn.Module:
        constraints = region.dtype_config.output_dtype_with_constraints
        if constraints.scale_exact_match is None:
            return self.build(region.qconfig.activation)
        fixed = FixedQParamsObserver.with_args(
            scale=constraints.scale_exact_match, zero_point=constraints.zero_point_exact_match,
            dtype=constraints.dtype, quant_min=constraints.quant_min_lower_bound,
            quant_max=constraints.quant_max_upper_bound)
        return FixedQParamsFakeQuantize(observer=fixed) if self.is_qat else fixed()

    def _new_observer(self, value: fx.Node, observer: nn.Module, role: str, *, reroute: bool,
                      dynamic: bool = False) -> fx.Node:
        name = f"{OBSERVER_PREFIX}{self.count}"
        self.count += 1
        observer.name = f"{role} of node {value.name!r}"
        self.gm.add_submodule(name, observer)
        return self._add_observer_node(value, name, role, reroute=reroute, dynamic=dynamic)

    def _add_observer_node(self, value: fx.Node, module_name: str, role: str, *, reroute: bool,
                           dynamic: bool = False) -> fx.Node:
        with self.gm.graph.inserting_after(value):
            node = self.gm.graph.call_module(module_name, args=(value,))
        node.meta[OBSERVER] = role
        node.meta.update({k: v for k, v in value.meta.items() if k in (VALUE_KIND, "nn_module_stack")})
        if reroute:
            value.replace_all_uses_with(node, delete_user_cb=lambda user: user is not node)
            self.standing_for[value] = node
        (self.dynamic_observer_of if dynamic else self.observer_of)[value] = node
        return node


def _observes_inputs(region: Region) -> bool:
    return region.dtype_config.input_dtype in QUANTIZED_DTYPES


def swap_qat_modules(gm: fx.GraphModule, regions: list[Region]) -> None:
    """Replace each quantized weighted root by its QAT module (weights get fake-quant)."""
    modules = dict(gm.named_modules(remove_duplicate=False))
    for region in regions:
        root = region.root
        if not (region.quantized and region.weighted and root.op == "call_module"):
            continue
        qat_class = region.config.qat_module
        module = modules[root.target]
        if qat_class is None or isinstance(module, qat_class):
            continue
        gm.set_submodule(root.target, qat_class.from_float(module, region.qconfig))


def tag_regions(regions: list[Region]) -> None:
    """Record each region's decision on its nodes for convert, lowering and the report."""
    for region_id, region in enumerate(regions):
        for node in region.match.nodes:
            node.meta[REGION] = RegionTag(
                region_id=region_id, is_anchor=node is region.anchor, pattern=region.match.pattern,
                pattern_name=region.pattern_name, quantized=region.quantized, reason=region.reason,
                weighted=region.weighted, is_dynamic=region.is_dynamic, qconfig=region.qconfig,
                dtype_config=region.dtype_config)
        if region.weighted and region.root.op == "call_module":
            region.root.meta[ROOT] = True


def is_observer_module(module: Any) -> bool:
    return isinstance(module, (ObserverBase, FakeQuantize))
