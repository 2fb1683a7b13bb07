"""Plain-data annotations that prepare leaves on nodes for convert and lowering.

Only plain values live in ``node.meta`` (no references to other nodes), so the tags survive
``copy.deepcopy`` of a GraphModule and every pass that copies meta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from qplug_core.errors import InputMismatchError

#: node.meta key: what the node's value is ("float_tensor", "tensor" or "other")
VALUE_KIND = "qplug_value"
#: node.meta key on a node whose example value is a tensor of another layout than strided (a sparse
#: adjacency for ``torch.sparse.mm``): the layout's name, as ``"torch.sparse_coo"``
LAYOUT = "qplug_layout"
#: node.meta key: the :class:`RegionTag` of the region the node belongs to
REGION = "qplug_region"
#: node.meta key on observer nodes: which value they observe and why ("input"/"output"/"shared")
OBSERVER = "qplug_observer"
#: node.meta key on quantize/dequantize boundary nodes
BOUNDARY = "qplug_boundary"
#: node.meta key on nodes that run a backend kernel: the kernel's op name
KERNEL = "qplug_kernel"
#: node.meta key on the root node of a region (the node whose module carries the weight)
ROOT = "qplug_root"
#: node.meta key on a call moved to a copy of a shared module (``fc_call1``): the path it was
#: written as (``fc``), which qconfig rules by module name match (flows/shared_modules.py)
CALLED_AS = "qplug_called_as"
#: node.meta key on a clamp folded into its producer's output range: its ``(low, high)`` bounds
FOLDED_CLAMP = "qplug_folded_clamp"
#: node.meta key: which plugin pass wrote which annotation (see ``fx.annotation_guard``)
ANNOTATION_OWNERS = "qplug_annotation_owners"

# Keys of ``GraphModule.meta`` (and one module attribute) that carry state between the flows.

#: GraphModule.meta key: the backend and mode a model was prepared for
STATE = "qplug_state"
#: GraphModule.meta key: the fusions fuse_fx applied (list of FusionRecord)
FUSIONS = "qplug_fusions"
#: GraphModule.meta key: the QuantizationReport a convert step attached
REPORT = "qplug_report"
#: GraphModule.meta key: the reference form convert kept before lowering (ReferenceSnapshot)
SNAPSHOT = "qplug_reference_snapshot"
#: GraphModule.meta key: each compiled partition's reference form, by submodule name, as fused into
#: the model: the nodes its delegate compiled, with the same inputs and outputs (qp.compare runs it)
PARTITION_FORMS = "qplug_partition_forms"
#: GraphModule.meta key of a region-by-region check graph (``flows/region_parity.py``): (the partition it
#: was cut from, [(its input node names, its output node name) per region]), so its ONNX model is cut
#: from the partition's (``onnx_export/region_models.py``)
CHECK_REGIONS = "qplug_check_regions"
#: GraphModule.meta key: layer (module path) -> the clamp its int8 output range holds
#: (``flows.clamps.AbsorbedClamp``: qp.compare pairs the layer with the float value after it)
ABSORBED_CLAMPS = "qplug_absorbed_clamps"
#: GraphModule.meta key: conv (module path) -> the per-channel affine (a frozen BatchNorm) folded into
#: its weights (``flows.channel_affine.FoldedAffine``: qp.compare pairs the conv with the float value after it)
FOLDED_AFFINES = "qplug_folded_affines"
#: attribute of a model quantized by ``qp.quantize_weights``: what was done (WeightOnlyInfo)
WEIGHT_ONLY = "qplug_weight_only"
#: attribute of a model quantized by ``qp.quantize_w8a8``: what was done (W8A8Info)
W8A8 = "qplug_w8a8"
#: attribute of a model from ``qp.quantize_weights`` / ``qp.quantize_w8a8``: its decode-step
#: thread choice (weight_only.decode_step.DecodeStepThreads)
DECODE_THREADS = "qplug_decode_threads"
#: GraphModule.meta key: the encoded reference form a model was loaded from (serialization.Artifact)
ARTIFACT = "qplug_artifact"
#: attribute of an eager-mode model prepared by ``qp.eager.prepare``
EAGER_STATE = "qplug_eager_state"
#: attribute of an eager-mode model prepared by ``qp.eager.prepare``: (args, kwargs) of its first
#: call, a few rows of each batched tensor, on which convert checks its kernels (eager/kernel_check.py)
EAGER_EXAMPLE = "qplug_eager_example"
#: an eager module attribute from prepare to convert: the input shapes a passthrough module whose
#: calls an int8 kernel may refuse (upsampling) was called with (eager/passthrough_checks.py)
EAGER_INPUT_SHAPES = "qplug_eager_input_shapes"
#: attribute of an eager-mode model converted by ``qp.eager.convert``: the backend's name
EAGER_CONVERTED = "qplug_eager_converted"
#: an eager module attribute: a backend rule chose its input qparams, convert requantizes to them
#: (the prepare mode, "static" or "qat": a QAT model fake-quantizes the input to them in training)
EAGER_INPUT_REQUANTIZED = "qplug_input_requantized"
#: a module attribute: why ``qp.quantize_dynamic``'s defaults left this layer float (its report says so)
DYNAMIC_LEFT_FLOAT = "qplug_dynamic_left_float"
#: a layer attribute: the :class:`~qplug_core.flows.bias_grid.BiasRecord` of a corrected bias
BIAS_CORRECTION = "_qplug_bias_correction"
#: a QConfigMapping attribute: set on a mapping ``flows.weight_bits.backend_defaults`` resolved
#: (``copy.deepcopy`` keeps it)
BACKEND_DEFAULTS = "_qplug_backend_defaults"
#: GraphModule.meta: the capture level used ("symbolic" or "export")
CAPTURE = "qplug_capture"
#: GraphModule.meta: submodules left opaque because capture failed, (name, type, reason)
CAPTURE_SKIPPED = "qplug_capture_skipped"
#: GraphModule.meta: the accuracy recipe qp.quantize applied, and the target's decisions
RECIPE = "qplug_recipe"
TARGET = "qplug_target"
#: GraphModule.meta: the error a calibration raised (converting after it is refused)
CALIBRATION_FAILED = "qplug_calibration_failed"
#: GraphModule.meta: backend="auto"'s ranking of the backends that kept the contract on the winner's
#: reference form, fastest first (``qp.save`` records it; ``qp.load`` lowers to the first one installed)
AUTO_RANKING = "qplug_auto_ranking"
#: GraphModule.meta: the example inputs prepare ran, replayed by the kernel contract at convert
EXAMPLE_INPUTS = "qplug_example_inputs"
#: GraphModule.meta: what convert could not check or decide, and why (the kernel contract not run,
#: the 8-bit weight search skipped), or where a backend's prepare pass overrode the user's qconfig;
#: moved into the report's ``notes`` when the conversion finishes
CONVERSION_NOTES = "qplug_conversion_notes"
#: GraphModule.meta: the 8-bit weight range convert may give a layer whose int16 pair sums cannot
#: saturate (set at prepare when a backend's defaults are 7-bit only for that), and the decisions
WEIGHT_BITS = "qplug_weight_bits"
WEIGHT_BITS_CHOICE = "qplug_weight_bits_choice"
#: GraphModule.meta: what convert decided per layer (weight qparams, why, 7-bit input grid), and
#: on an observed graph, the decisions of an earlier convert of the same calibrated layers that
#: its convert takes as they are (a target search's tries, ``algorithms/target.py``)
WEIGHT_BITS_DECIDED = "qplug_weight_bits_decided"
WEIGHT_BITS_REUSE = "qplug_weight_bits_reuse"
#: node.meta key on a module node made from a functional call on a constant weight (``F.linear``,
#: ``F.conv2d``...): that function, so tools can tell which functional pattern the module stands for
FROM_FUNCTIONAL = "qplug_from_functional"
#: GraphModule.meta key: layer (module path) made from a functional call -> the path of the float
#: weight the call was given (qp.compare finds that call in the float model by its weight)
FUNCTIONAL_WEIGHTS = "qplug_functional_weights"
#: GraphModule.meta: a few calibration batches kept for convert's decisions (flows/calibration_sample.py)
CALIBRATION_SAMPLE = "qplug_calibration_sample"
#: GraphModule.meta: the first calibration batch and the float output calibration computed for it,
#: what the final check scores the converted model on (flows/first_batch.py)
FIRST_BATCH = "qplug_first_batch"
#: ... and the inputs of the observed model's first call, held while that call runs
FIRST_CALL_INPUTS = "qplug_first_call_inputs"
#: GraphModule.meta on a fused float graph whose function a step changed before prepare (bias
#: correction moves biases): what changed it. Its observed model's outputs are not the float model's
FLOAT_EDITED = "qplug_float_edited"
#: node.meta key on tensor placeholders: ``{"shape": [...], "dtype": "float32"}`` of the example
#: input, so exporters and compiling backends can rebuild inputs of the same kind (also after load)
INPUT_SPEC = "qplug_input_spec"
#: GraphModule.meta key: an exported program's ``range_constraints`` (size expression -> its
#: range), kept when its guards are dropped for :mod:`qplug_core.flows.input_relations` (not saved)
EXPORT_RANGES = "qplug_export_ranges"
#: node.meta key on a placeholder torch.export built into the graph as a constant (a Python int,
#: float or bool argument, or None: export takes none as an input): the example's value, which
#: every call must give (:mod:`qplug_core.flows.exported_inputs`)
BAKED_INPUT = "qplug_baked_input"
#: the Python values export builds in for an argument (a SymInt is an input's size, not an argument)
BAKED_TYPES = (bool, int, float, type(None))
#: GraphModule.meta: forward keyword the capture left at its value -> the values a call may still
#: give it, the one the capture used first, then None when that value came from the model's config
#: (``return_dict=True``; :mod:`qplug_core.flows.fixed_keywords`, :mod:`qplug_core.ir.fixed_values`)
FIXED_KEYWORDS = "qplug_fixed_keywords"
#: dtypes an input spec may name (what ``input_spec``/``example_from_spec`` round-trip)
SPEC_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


@dataclass(frozen=True)
class RegionTag:
    """What prepare decided for the region a node belongs to."""

    region_id: int
    is_anchor: bool
    pattern: Any
    pattern_name: str
    quantized: bool
    reason: str
    weighted: bool
    is_dynamic: bool
    qconfig: Any = None
    dtype_config: Any = None


def value_kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "float_tensor" if value.is_floating_point() else "tensor"
    return "other"


class ValueAnnotator(fx.Interpreter):
    """Runs the graph once on example inputs and records each node's value kind (and a tensor's
    layout when it is not strided).

    Knowing which values are float tensors lets prepare observe exactly those (never integer
    indices, shapes or tuples), instead of guessing from op names.
    """

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        n.meta[VALUE_KIND] = value_kind(result)
        if isinstance(result, torch.Tensor) and result.layout != torch.strided:
            n.meta[LAYOUT] = str(result.layout)
        if n.op == "placeholder" and isinstance(result, torch.Tensor):
            spec = input_spec(result)
            if spec is not None:
                n.meta[INPUT_SPEC] = {**spec, **captured_sizes(n)}
        elif n.op == "placeholder" and "val" in n.meta and type(n.meta["val"]) in BAKED_TYPES:
            n.meta[BAKED_INPUT] = n.meta["val"]  # export's constant: the example's value
        return result


def captured_sizes(placeholder: fx.Node) -> dict[str, list]:
    """``{"fixed": dims, "symbols": names}``: the dimensions torch.export specialised to the
    example's size (its placeholder's fake value has an int there, or a symbol bounded to one
    value: ``Dim.AUTO`` gives a Linear's feature size as the constant ``SymInt`` 40), and per
    dimension the symbol export gave a dynamic size (``None`` for a fixed one or an expression):
    dimensions of one symbol must be equal (export traced ``t.size(0) == x.size(0)``). Empty for a
    symbolically traced graph, which fixes none. The converted model checks them
    (:mod:`qplug_core.flows.exported_inputs`): the graph holds the example's sizes and branches there."""
    value = placeholder.meta.get("val")
    shape = getattr(value, "shape", None)
    if shape is None:
        return {}
    return {"fixed": [i for i, size in enumerate(shape) if _one_value(size)],
            "symbols": [_symbol(size) for size in shape]}


def _symbol(size: int | torch.SymInt) -> str | None:
    """The name of the symbol a dynamic size is (``None``: fixed, or an expression of symbols)."""
    if _one_value(size) or not isinstance(size, torch.SymInt) or not size.node.expr.is_symbol:
        return None
    return str(size.node.expr)


def _one_value(size: int | torch.SymInt) -> bool:
    if not isinstance(size, torch.SymInt):
        return True
    bounds = size.node.shape_env.bound_sympy(size.node.expr)
    return bool(bounds.lower == bounds.upper)


def input_spec(value: torch.Tensor) -> dict[str, Any] | None:
    """The :data:`INPUT_SPEC` of an example tensor (``None`` for a dtype outside SPEC_DTYPES)."""
    dtype = str(value.dtype).removeprefix("torch.")
    return {"shape": list(value.shape), "dtype": dtype} if dtype in SPEC_DTYPES else None


def example_from_spec(spec: dict[str, Any]) -> torch.Tensor:
    """A tensor of the recorded shape and dtype (zeros: only shapes and dtypes are recorded)."""
    return torch.zeros(spec["shape"], dtype=SPEC_DTYPES[spec["dtype"]])


def region_tag(node: fx.Node) -> RegionTag | None:
    return node.meta.get(REGION)


def recorded_example_inputs(gm: fx.GraphModule) -> tuple[torch.Tensor, ...]:
    """Inputs shaped like the example inputs the model was prepared with (:data:`INPUT_SPEC`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    missing = [n.name for n in placeholders if INPUT_SPEC not in n.meta]
    if missing:
        raise InputMismatchError(f"the shapes of input(s) {missing} were not recorded when the model "
                                 "was prepared; pass example inputs explicitly")
    return tuple(example_from_spec(n.meta[INPUT_SPEC]) for n in placeholders)
