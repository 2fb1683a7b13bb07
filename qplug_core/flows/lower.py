"""Lowering: replace reference regions (dequantize -> float op -> quantize) by backend kernels.

For each quantized region whose pattern the backend has a kernel for, the kernel module takes the
*quantized* inputs directly and produces the quantized output, so consecutive int8 ops pass
quantized tensors to each other with no dequantize/quantize pair in between. Regions without a
kernel keep the reference form. Finally the reference ``Quantize``/``Dequantize`` boundaries are
swapped for the backend's own (which create the backend's quantized tensors).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from qplug_core.errors import ConfigValidationError, ConstraintViolationError, warn_user
from qplug_core.flows import kernel_check as kernel_contract
from qplug_core.flows.conv1d_layout import keep_conv1d_layouts
from qplug_core.flows.graph_utils import is_module_call
from qplug_core.flows.report import report_names
from qplug_core.flows.split_pieces import is_split, split_of
from qplug_core.flows.tags import CONVERSION_NOTES, KERNEL, REGION, ROOT, VALUE_KIND, region_tag
from qplug_core.ir import module_stack
from qplug_core.kernels.base import (
    DEQUANTIZE_KEY,
    QUANTIZE_KEY,
    KernelContext,
    KernelSpec,
    TensorArg,
    engine_context,
)
from qplug_core.kernels.passthrough import dense_batch_stride, reads_batch_stride
from qplug_core.kernels.reference import (
    Dequantize,
    DynamicQuantize,
    Quantize,
    ReferenceRecurrent,
    ReferenceWeighted,
)
from qplug_core.qparams import STORAGE_DTYPE, QParams


@dataclass
class LoweringSummary:
    """Which regions run on backend kernels, and which stayed in reference form and why."""

    lowered: dict[str, str] = field(default_factory=dict)  # anchor node -> kernel op
    reference: dict[str, str] = field(default_factory=dict)  # anchor node -> reason


@dataclass
class _RegionNodes:
    members: list[fx.Node] = field(default_factory=list)
    anchor: fx.Node | None = None
    name: str = ""  # the anchor as reports name it (``0``, ``layer1.conv``): warnings say the same


def lower_graph(gm: fx.GraphModule, backend, keep_reference: dict[str, str] | None = None,
                replaced: Callable[[str], None] | None = None) -> LoweringSummary:
    """Lower ``gm`` (reference form) to ``backend``'s kernels, in place; the regions named in
    ``keep_reference`` (anchor -> why, recorded at convert: ``qp.load``) stay in reference form.
    ``replaced(path)`` is called as soon as a kernel takes the place of the layer at ``path``."""
    keep_reference = keep_reference or {}
    summary = LoweringSummary()
    report_key = report_names(gm.graph)
    regions = _quantized_regions(gm)
    probes = {tag.region_id: _probe(gm, nodes, tag, spec.passthrough) for tag, nodes in regions
              if (spec := backend.kernels.get(tag.pattern)) is not None}
    contract = kernel_contract.record(gm, probes)
    if contract.failed:
        note = (f"kernel contract not checked: the reference form did not run on the example inputs "
                f"({contract.failed}), so backend {backend.name!r}'s kernels were installed unchecked")
        warn_user(f"qplug: {note}; qp.compare(float_model, qmodel, data) measures the result")
        gm.meta.setdefault(CONVERSION_NOTES, []).append(note)
    without_kernel: dict[str, str] = {}  # weighted layer -> its pattern, when the backend has no kernel
    refused: dict[str, str] = {}  # region -> why its kernel refused it
    for tag, nodes in regions:
        spec = backend.kernels.get(tag.pattern)
        name = nodes.name = report_key(nodes.anchor)
        if name in keep_reference:
            summary.reference[name] = keep_reference[name]
            continue
        if spec is None:
            summary.reference[name] = f"backend {backend.name!r} has no kernel for {tag.pattern_name}"
            if tag.weighted:  # named by its layer, not by the anchor (the relu of ReLU <- Linear)
                without_kernel[report_key(_root(nodes) or nodes.anchor)] = tag.pattern_name
            continue
        problem = _self_test_problem(backend, spec, tag.pattern)
        if problem:
            summary.reference[name] = problem
            continue
        root = _root(nodes)
        problem = _why_not_lowered(gm, backend, spec, tag, nodes, contract, refused)
        if problem:
            summary.reference[name] = problem
        else:
            summary.lowered[name] = spec.op
            if replaced is not None and root is not None and root.op == "call_module":
                replaced(str(root.target))
    _warn_without_kernel(backend, without_kernel)
    _warn_refused(backend, refused)
    _swap_boundaries(gm, backend)
    gm.graph.eliminate_dead_code()
    keep_conv1d_layouts(gm)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    return summary


def _root(nodes: _RegionNodes) -> fx.Node | None:
    """The region's layer (the module call holding its weights), if it has one."""
    return next((m for m in nodes.members if m.meta.get(ROOT)), None)


def _warn_without_kernel(backend, layers: dict[str, str]) -> None:
    """One warning for the weighted layers the backend has no kernel for: they were asked for int8 and
    run the reference form's float compute, which the report alone left unsaid."""
    if layers:
        named = ", ".join(f"{name!r} ({pattern})" for name, pattern in layers.items())
        warn_user(f"qplug: backend {backend.name!r} has no int8 kernel for these layers, which run in "
                  f"reference form (int8-rounded weights, float compute): {named}. Use a backend with such "
                  "kernels, or set their qconfig to None to keep them float")


def _warn_refused(backend, refused: dict[str, str]) -> None:
    """One warning for the regions whose kernel refused them (a UNet's up-convolutions), not one
    per region: each runs the reference form's float compute, which the warning says."""
    if refused:
        named = "; ".join(f"node {name!r}: {why}" for name, why in refused.items())
        warn_user(f"qplug: backend {backend.name!r} runs {len(refused)} region(s) in reference form "
                  f"(int8-rounded values, float compute) because their kernel refused them: {named}")


def _quantized_regions(gm: fx.GraphModule):
    regions: dict[int, _RegionNodes] = defaultdict(_RegionNodes)
    tags = {}
    for node in gm.graph.nodes:
        tag = region_tag(node)
        if tag is None or not tag.quantized:
            continue
        regions[tag.region_id].members.append(node)
        tags[tag.region_id] = tag
        if tag.is_anchor:
            regions[tag.region_id].anchor = node
    return [(tags[i], r) for i, r in regions.items() if r.anchor is not None]


_self_test_results: dict[tuple[str, str], str] = {}


def _self_test_problem(backend, spec: KernelSpec, pattern: Any) -> str:
    """Run a kernel's self-test once per process; a failing kernel falls back with a warning
    naming the plugin that registered it."""
    if spec.self_test is None:
        return ""
    key = (backend.name, spec.op)
    if key not in _self_test_results:
        try:
            spec.self_test()
            _self_test_results[key] = ""
        except Exception as error:  # a broken kernel must not break conversion
            _self_test_results[key] = (f"kernel {spec.op} of {_plugin_label(backend, pattern)} failed its "
                                       f"self-test ({error}); using the reference form")
            warn_user(f"qplug: backend {backend.name!r}: {_self_test_results[key]}")
    return _self_test_results[key]


def _plugin_label(backend, pattern: Any) -> str:
    """The plugin that registered ``backend``'s kernel for ``pattern`` (name and distribution)."""
    owner = backend.kernel_plugins.get(pattern)
    return f"plugin {owner.label}" if owner is not None else "an unregistered plugin"


def _region_io(gm: fx.GraphModule, nodes: _RegionNodes, tag
               ) -> tuple[fx.Node, list[fx.Node], fx.Node | None]:
    """The node a kernel replaces, its dequantize boundaries and the quantize of its output.

    A float-output kernel (weight-only embedding, dynamic linear) has no output quantize: the one
    after it belongs to whatever int8 op consumes the value.
    """
    compute = next((m for m in nodes.members if _input_boundaries(gm, m)), nodes.anchor)
    output_quantize = _single_user(nodes.anchor, gm, Quantize) if _quantized_output(tag) else None
    return compute, _input_boundaries(gm, compute), output_quantize


_NOT_QUANTIZED = "its inputs or output are not quantized in this graph"


def _lower_region(gm: fx.GraphModule, backend, spec: KernelSpec, tag, nodes: _RegionNodes,
                  contract: kernel_contract.ContractRun) -> str:
    """Put ``spec``'s kernel in place of the region; '' if done, else why the region stays reference."""
    anchor = nodes.anchor
    split = split_of(anchor)
    if split is not None and not _input_boundaries(gm, split):
        return ""  # a piece of a split lowered before it: it reads the int8 piece already
    compute, boundaries, output_quantize = _region_io(gm, nodes, tag)
    if _quantized_input(tag) and _unquantized_input(compute, boundaries):
        return _NOT_QUANTIZED
    outputs = _piece_quantizes(gm, anchor) if is_split(anchor) else [output_quantize]
    if spec.passthrough and (None in outputs or len(boundaries) != 1):
        return _NOT_QUANTIZED  # its op runs on one quantized input, its output keeps those qparams
    root = _root(nodes)
    module = gm.get_submodule(root.target) if root is not None else None
    weight_qparams, recurrent_weight_qparams = None, None
    if isinstance(module, ReferenceWeighted):
        module, weight_qparams = module.module, module.weight_qparams
    elif isinstance(module, ReferenceRecurrent):
        # each (already rounded) weight matrix is packed with the qparams it was rounded with: the
        # qconfig is not saved, and observing the rounded weights again gives other scales
        module, recurrent_weight_qparams = module.module, module.weight_qparams
        weight_qparams = next(iter(recurrent_weight_qparams.values()))
    elif root is None and compute.op == "call_module":
        module = gm.get_submodule(compute.target)
    index = {b: i for i, b in enumerate(boundaries)}
    ctx = KernelContext(
        pattern=tag.pattern, module=module, target=compute.target if compute.op != "call_module" else None,
        args=_with_tensor_args(compute.args, index), kwargs=_with_tensor_args(compute.kwargs, index),
        input_qparams=tuple(_boundary_qparams(gm, b) for b in boundaries),
        output_qparams=gm.get_submodule(output_quantize.target).qparams if output_quantize else None,
        weight_qparams=weight_qparams, engine=backend.engine,
        recurrent_weight_qparams=recurrent_weight_qparams, input_shapes=_example_shapes(boundaries, contract))
    try:
        kernel = _passthrough_op(gm, spec, ctx, compute, backend.engine) if spec.passthrough else spec.build(ctx)
    except ConstraintViolationError as refusal:  # the kernel refused this instance, in its own words
        raise ConstraintViolationError(f"kernel {spec.op} refused this region: {refusal}") from refusal
    except ConfigValidationError as error:  # the region lacks what the kernel needs (qparams another
        # backend's patterns leave out: a model prepared for onnxruntime, converted for fbgemm)
        raise ConstraintViolationError(_unbuildable(spec, ctx, error)) from error
    except Exception as error:  # a plugin's build is plugin code: its bug costs one region, not the flow
        step = "check(ctx)" if spec.passthrough else "build(ctx)"
        return _kernel_failed(backend, spec, tag, nodes, f"raised {type(error).__name__} in {step}: {error}")
    problem = _contract_problem(gm, backend, spec, kernel, tag, nodes, contract)
    if problem:
        return problem
    if spec.passthrough:
        _drop_boundaries(gm, nodes, boundaries[0], outputs, kernel.batch_stride_read)
        return ""
    kernel_name = root.target if root is not None else _free_module_name(gm, compute, spec.op)
    gm.set_submodule(kernel_name, kernel)
    # quantized-input kernels take the quantized tensors; float-input ones (weight-only) the node's args
    args, kwargs = (tuple(b.args[0] for b in boundaries), {}) if boundaries else (compute.args, compute.kwargs)
    if compute.op == "call_module" and compute.target == kernel_name:
        new = compute  # the module call now runs the kernel, keeping its name and place
        new.args, new.kwargs = args, kwargs
    else:
        with gm.graph.inserting_before(anchor):
            new = gm.graph.create_node("call_module", kernel_name, args, kwargs,
                                       name=kernel_name.replace(".", "_"))
    new.meta.update({k: v for k, v in anchor.meta.items() if k not in (ROOT, REGION)})
    new.meta.pop(REGION, None)
    new.meta[KERNEL] = spec.op
    (output_quantize or anchor).replace_all_uses_with(new)
    return ""


def _example_shapes(boundaries: list[fx.Node], contract: kernel_contract.ContractRun
                    ) -> tuple[tuple[int, ...], ...]:
    """The shapes the example inputs gave the region's quantized inputs (none when no example was
    recorded), so that a passthrough check can refuse a rank torch has no quantized kernel for."""
    values = [contract.values.get(b) for b in boundaries]
    if not contract.available or not all(isinstance(v, torch.Tensor) for v in values):
        return ()
    return tuple(tuple(v.shape) for v in values)


def _unbuildable(spec: KernelSpec, ctx: KernelContext, error: ConfigValidationError) -> str:
    """Why ``spec`` cannot be built from the region's qparams, in the user's terms where known."""
    if error.field == "output_qparams" and ctx.output_qparams is None:
        return (f"kernel {spec.op} writes an int8 output, and this region's output is float: the model was "
                "quantized for a backend whose runtime leaves it float (it folds the dequantization into "
                "the layer, as onnxruntime does)")
    return f"kernel {spec.op} cannot be built for this region: {error}"


def _probe(gm: fx.GraphModule, nodes: _RegionNodes, tag, passthrough: bool) -> kernel_contract.RegionProbe:
    compute, boundaries, _ = _region_io(gm, nodes, tag)
    sources = {b: b.args[0] for b in boundaries}
    layouts = {b: s.args[0] for b, s in sources.items() if is_module_call(gm, s, Quantize)}
    if passthrough:  # the op's own arguments, its int8 input given as the backend's tensor
        return kernel_contract.RegionProbe(nodes.anchor, sources=sources, layouts=layouts,
                                           call=(compute.args, dict(compute.kwargs)))
    if boundaries:
        return kernel_contract.RegionProbe(nodes.anchor, sources=sources, layouts=layouts)
    return kernel_contract.RegionProbe(nodes.anchor, call=(compute.args, dict(compute.kwargs)))


def _backend_quantize(gm: fx.GraphModule, backend, holder: fx.Node, value: torch.Tensor,
                      fallback: torch.Tensor) -> torch.Tensor:
    """``value`` as the backend's quantized tensor with the qparams of reference module ``holder``
    (the reference integers ``fallback`` when the backend keeps the reference boundaries)."""
    spec = backend.kernels.get(QUANTIZE_KEY)
    if spec is None:
        return fallback
    qparams = gm.get_submodule(holder.target).qparams
    return spec.build(KernelContext(pattern=QUANTIZE_KEY, module=None, target=None,
                                    output_qparams=qparams, engine=backend.engine))(value)


def _contract_problem(gm: fx.GraphModule, backend, spec: KernelSpec, kernel: torch.nn.Module, tag,
                      nodes: _RegionNodes, contract: kernel_contract.ContractRun) -> str:
    """Run the new kernel once on its region's example inputs (see :mod:`kernel_contract`), under
    the backend's engine as the pinned model runs it: ops without packed weights (add, cat,
    pooling) dispatch on the global engine, and x86's add took a scale ratio qnnpack's refuses."""
    probe = contract.probes.get(tag.region_id)
    if not contract.available or probe is None:
        return ""
    values = contract.values
    quantized = {b: values[source] if is_module_call(gm, b, DynamicQuantize)
                 else _as_passed(_backend_quantize(gm, backend, b, values[b], values[source]), probe, b, contract)
                 for b, source in probe.sources.items()}
    if quantized and not spec.passthrough:  # an int8 kernel takes its quantized inputs alone
        args, kwargs = tuple(quantized.values()), {}
    else:  # a float-input kernel the node's arguments; a passthrough op, those with its int8 input
        args, kwargs = fx.map_arg(probe.call, lambda n: quantized.get(n, values[n]))
    reference, scale = values[nodes.anchor], None
    _, _, output_quantize = _region_io(gm, nodes, tag)
    if is_split(nodes.anchor):  # its pieces, each quantized as its read's quantize does (one observer)
        output_quantize = _piece_quantizes(gm, nodes.anchor)[0]
        quantize = gm.get_submodule(output_quantize.target)
        reference = tuple(_backend_quantize(gm, backend, output_quantize, piece, quantize(piece))
                          for piece in reference)
    elif output_quantize is not None:
        quantize = gm.get_submodule(output_quantize.target)
        reference = _backend_quantize(gm, backend, output_quantize, reference, quantize(reference))
        scale = float(quantize.qparams.scale) if quantize.qparams.scale.numel() == 1 else None
    if isinstance(reference, torch.Tensor) and not reference.is_quantized \
            and not reference.is_floating_point():
        scale = 1.0  # a plain-integer kernel (the reference form's integers): one step is 1
    expected_dtype = reference.dtype if isinstance(reference, torch.Tensor) else None
    with engine_context(backend.engine):
        problem = kernel_contract.violation(kernel, args, kwargs, reference, expected_dtype, scale)
    if not problem:
        return ""
    return _kernel_failed(backend, spec, tag, nodes,
                          f"{kernel_contract.CONTRACT_BROKEN} on the example inputs ({problem})")


def _as_passed(value: torch.Tensor, probe: kernel_contract.RegionProbe, boundary: fx.Node,
               contract: kernel_contract.ContractRun) -> torch.Tensor:
    """A region's quantized input laid out as the lowered model passes it: as the float value its
    integers were quantized from, recorded on the example (a backend's quantize lays out anew, and
    the views between two kernels keep their input's layout)."""
    source = probe.layouts.get(boundary)
    stride = contract.strides.get(source) if source is not None else None
    return kernel_contract.with_strides(value, stride) if stride else value


def _kernel_failed(backend, spec: KernelSpec, tag, nodes: _RegionNodes, what: str) -> str:
    """Why a region stays in reference form after its kernel failed; warned naming the plugin to
    blame (name and distribution), the kernel and the node, so its author knows where to look."""
    reason = f"kernel {spec.op} of {_plugin_label(backend, tag.pattern)} {what}; using the reference form"
    warn_user(f"qplug: backend {backend.name!r}, node {nodes.name!r}: {reason}")
    return reason


def _quantized_output(tag) -> bool:
    config = tag.dtype_config
    return config is None or (not tag.is_dynamic and config.output_dtype in STORAGE_DTYPE)


def _why_not_lowered(gm: fx.GraphModule, backend, spec: KernelSpec, tag, nodes: _RegionNodes,
                     contract: kernel_contract.ContractRun, refused: dict[str, str]) -> str:
    """Lower one region; an empty string when it now runs the kernel, else why it stays reference
    (also recorded in ``refused`` when the kernel refused it, for one warning about all)."""
    runtime = [] if spec.passthrough else _runtime_operands(nodes)
    inputs = [a.name for a in runtime if a.op == "placeholder"]
    if inputs:  # nn.LSTM given a PackedSequence: no quantize op in the graph can reach its data
        reason = (f"its input(s) {inputs} are forward() arguments that are not tensors (a PackedSequence, "
                  "a Python value): graph mode quantizes tensors only, so it stays in reference form "
                  "(qp.quantize_dynamic runs nn.LSTM / nn.GRU on PackedSequence inputs with int8 kernels)")
        warn_user(f"qplug: backend {backend.name!r}, node {nodes.name!r}: {reason}")
        return reason
    if runtime:
        return (f"operand(s) {[a.name for a in runtime]} are Python values computed at run time; kernel "
                f"{spec.op} needs them when it is built")
    try:
        return _lower_region(gm, backend, spec, tag, nodes, contract)
    except ConstraintViolationError as refusal:  # the kernel refused this instance (before any edit)
        refused[nodes.name] = str(refusal)
        return str(refusal)


def _runtime_operands(nodes: _RegionNodes) -> list[fx.Node]:
    """Inputs of the region that are non-tensor values: computed by the graph (``x.size(1) + 0``)
    or given to forward()."""
    members = set(nodes.members)
    return [a for m in nodes.members for a in m.all_input_nodes
            if a not in members and a.meta.get(VALUE_KIND) == "other"]


def _free_module_name(gm: fx.GraphModule, node: fx.Node, op: str) -> str:
    """A readable, unused module path for a functional kernel: ``layer1.0.add_relu``."""
    scopes = [path for path, _ in module_stack.scopes(node) if path != node.target]
    scope = scopes[-1] if scopes and _has_submodule(gm, scopes[-1]) else ""
    base = op.rpartition(":")[2] or "kernel"
    candidate, suffix = f"{scope}.{base}" if scope else base, 0
    while _has_submodule(gm, candidate):
        suffix += 1
        candidate = f"{scope}.{base}_{suffix}" if scope else f"{base}_{suffix}"
    return candidate


def _has_submodule(gm: fx.GraphModule, name: str) -> bool:
    try:
        gm.get_submodule(name)
    except AttributeError:
        return False
    return True


def _input_boundaries(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if is_module_call(gm, a, (Dequantize, DynamicQuantize))]


def _quantized_input(tag) -> bool:
    """The region's kernel takes int8 activations (a weight-only op takes its float operands as they
    are: an embedding bag's ``per_sample_weights``)."""
    config = tag.dtype_config
    return config is not None and not tag.is_dynamic and config.input_dtype in STORAGE_DTYPE


def _unquantized_input(node: fx.Node, boundaries: list[fx.Node]) -> bool:
    """A float tensor ``node`` reads not through a dequantize boundary: an int8 kernel, which takes
    only the quantized tensors, would drop it (a ``cat`` of an int8 and a float value)."""
    return any(a.meta.get(VALUE_KIND) == "float_tensor" for a in node.all_input_nodes
               if a.op != "get_attr" and a not in boundaries)


def _single_user(node: fx.Node, gm: fx.GraphModule, cls: type) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and is_module_call(gm, users[0], cls) else None


def _boundary_qparams(gm: fx.GraphModule, boundary: fx.Node) -> QParams:
    module = gm.get_submodule(boundary.target)
    if isinstance(module, DynamicQuantize):
        return QParams(torch.tensor(1.0), torch.tensor(0), module.dtype, module.quant_min,
                       module.quant_max, is_dynamic=True)
    return module.qparams


def _with_tensor_args(value: Any, index: dict[fx.Node, int]) -> Any:
    if isinstance(value, fx.Node):
        return TensorArg(index[value]) if value in index else value
    if isinstance(value, (list, tuple)):
        return type(value)(_with_tensor_args(v, index) for v in value)
    if isinstance(value, dict):
        return {k: _with_tensor_args(v, index) for k, v in value.items()}
    return value


def _passthrough_op(gm: fx.GraphModule, spec: KernelSpec, ctx: KernelContext, node: fx.Node,
                    engine: str | None) -> torch.nn.Module:
    """A passthrough region's op as lowering leaves it, once its spec accepts the call."""
    if spec.check is not None:
        spec.check(ctx)
    return _PassthroughOp(gm, node, engine)


class _PassthroughOp(torch.nn.Module):
    """The op of a passthrough region run on the backend's quantized tensors, as the lowered graph
    runs it (under the model's pinned engine): what the kernel contract checks in its place, so that
    a call torch has no quantized kernel for keeps the reference form instead of raising at every call."""

    def __init__(self, gm: fx.GraphModule, node: fx.Node, engine: str | None) -> None:
        super().__init__()
        self.kind, self.target, self.engine = node.op, node.target, engine
        self.module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        #: its int8 input goes through ``dense_batch_stride`` (a node lowering inserts before it)
        self.batch_stride_read = reads_batch_stride(self.module if self.module is not None else node.target)

    def forward(self, *args, **kwargs):
        if self.batch_stride_read:
            args = (dense_batch_stride(args[0]), *args[1:])
        with engine_context(self.engine):
            if self.module is not None:
                return self.module(*args, **kwargs)
            if self.kind == "call_method":
                return getattr(args[0], str(self.target))(*args[1:], **kwargs)
            return self.target(*args, **kwargs)


def _drop_boundaries(gm: fx.GraphModule, nodes: _RegionNodes, boundary: fx.Node, output_quantizes: list,
                     batch_stride_read: bool) -> None:
    """Lower a passthrough region: its op reads the quantized tensor (through ``dense_batch_stride``
    for an op whose kernel misreads some batch-1 views) and its output (a split's pieces) is used as is."""
    source = boundary.args[0]
    if batch_stride_read:
        with gm.graph.inserting_after(boundary):
            source = gm.graph.call_function(dense_batch_stride, (source,))
        source.meta[KERNEL] = "passthrough"  # part of the op's int8 run, no float compute
    for member in nodes.members:
        member.replace_input_with(boundary, source)
    for quantize in output_quantizes:
        quantize.replace_all_uses_with(quantize.args[0])


def _piece_quantizes(gm: fx.GraphModule, split: fx.Node) -> list[fx.Node | None]:
    """The quantize after each piece read of a split (None where one is missing)."""
    return [_single_user(piece, gm, Quantize) for piece in split.users]


def _swap_boundaries(gm: fx.GraphModule, backend) -> None:
    quantize_spec = backend.kernels.get(QUANTIZE_KEY)
    dequantize_spec = backend.kernels.get(DEQUANTIZE_KEY)
    for node in gm.graph.nodes:
        if node.op != "call_module" or not node.users:
            continue
        module = gm.get_submodule(node.target)
        if type(module) is Quantize and quantize_spec is not None:
            ctx = KernelContext(pattern=QUANTIZE_KEY, module=None, target=None,
                                output_qparams=module.qparams, engine=backend.engine)
            gm.set_submodule(node.target, quantize_spec.build(ctx))
        elif type(module) is Dequantize and dequantize_spec is not None:
            ctx = KernelContext(pattern=DEQUANTIZE_KEY, module=None, target=None,
                                input_qparams=(module.qparams,), engine=backend.engine)
            gm.set_submodule(node.target, dequantize_spec.build(ctx))

