"""The kernel contract, enforced at convert: each lowered kernel is run once and checked.

A third-party kernel is code qplug cannot review. Before lowering puts one into the graph, it runs
it on the inputs that its region saw when the reference form ran on the example inputs given to
``prepare_fx`` (kept in ``GraphModule.meta``), laid out as that run made them (a kernel can be wrong
on one layout only: a batch-1 view of transposed tokens), and compares with the reference form's output:

* same shape, a finite result, and the dtype the graph expects there (the backend's quantized
  dtype after a quantized output, float otherwise);
* within :data:`MAX_STEPS` quantization steps of the reference output on at least
  ``1 - MAX_OUTLIER_FRACTION`` of the elements (a float output is measured in steps of an 8-bit
  grid over the reference output's range). Real kernels differ from the reference by rounding
  (at most 1 step on every model of the zoo, fbgemm and qnnpack);
* no channel wrong as a whole (:func:`wrong_channel`): one output channel of 256 off on every
  element (an int32 bias that overflowed) is under 1% of the elements, but a broken kernel;
* and not off the same way on average (:data:`MAX_BIAS_STEPS`): an output zero point off by one
  is one step off on every element, within MAX_STEPS everywhere. Compiled partitions are held to
  the same rule (:mod:`qplug_core.flows.delegate`).

A kernel that breaks it is not used: its region keeps the reference form, with a warning naming
the plugin, and the report says why. A model without recorded example inputs (``qp.load``) skips
the check; so does one whose reference form no longer runs on them (a plugin pass changed the
graph), with a warning and a note in the report, as its kernels then go in unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from qplug_core.errors import first_line
from qplug_core.flows.native_stderr import echo, native_stderr, raised
from qplug_core.flows.tags import EXAMPLE_INPUTS

#: the words every reason for a region kept in reference form after a wrong kernel or partition says
CONTRACT_BROKEN = "broke the kernel contract"
#: a kernel output may differ from the reference by at most this many quantization steps ...
MAX_STEPS = 2
#: ... except on this fraction of its elements (measured on the zoo: real kernels are within 1 step)
MAX_OUTLIER_FRACTION = 0.01
#: an output's mean signed error, in steps: roundings that differ go both ways, a zero point off by
#: one moves every element the same way (within MAX_STEPS on all of them)
MAX_BIAS_STEPS = 0.25


def wrong_channel(off: torch.Tensor) -> tuple[int, int] | None:
    """(dimension, index) of a channel of an output whose elements are mostly off (``off``: where
    they differ beyond the tolerance), or None. A channel is a slice along dimension 1 (a conv's
    NCHW output) or the last one (a linear's features), with at least 2 and more than half of its
    elements off: rounding puts single elements astray, never most of a channel."""
    if off.dim() < 2:
        return None
    for dim in dict.fromkeys((1, off.dim() - 1)):
        counts = off.movedim(dim, 0).reshape(off.shape[dim], -1).sum(1)
        wrong = (counts >= 2) & (2 * counts > off.numel() // off.shape[dim])
        if bool(wrong.any()):
            return dim, int(wrong.nonzero()[0])
    return None


def float_step(expected: torch.Tensor) -> float:
    """One quantization step of a float output: its range / 255 (1 where it is constant or empty)."""
    return (float(expected.max() - expected.min()) / 255 if expected.numel() else 0.0) or 1.0


#: absolute difference a float output may have before it counts as off at all (float rounding;
#: outputs a runtime flushes to zero below float32's normal range)
FLOAT_SLACK = 1e-6


def steps_off(actual: torch.Tensor, expected: torch.Tensor, step: float) -> torch.Tensor:
    """How many steps of ``step`` each float output is off (int64); within ``k`` steps is
    ``<= k``, with :data:`FLOAT_SLACK` for float rounding."""
    return ((actual.float() - expected.float()).abs().sub(FLOAT_SLACK).div(step).ceil().clamp_min(0)
            .to(torch.int64))


def signed_steps(actual: torch.Tensor, expected: torch.Tensor, step: float) -> torch.Tensor:
    """Each float output's signed difference in steps of ``step`` (float64), past the same
    :data:`FLOAT_SLACK`: the mean says whether a kernel is biased."""
    diff = actual.double() - expected.double()
    return diff.sign() * (diff.abs() - FLOAT_SLACK).clamp_min(0) / step


def bias_steps(out: object, ref: object, scale: float | None) -> float:
    """The mean signed difference of ``out`` from ``ref`` in steps (``scale``, or the reference's
    range / 255 as the contract counts float outputs; quantized outputs dequantized); 0 where
    they are not tensors to compare."""
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor) or out.shape != ref.shape \
            or ref.numel() == 0:
        return 0.0
    out, ref = as_float(out), as_float(ref)
    if ref.is_floating_point():
        return float(signed_steps(out, ref, scale or float_step(ref)).mean())
    return float((out.double() - ref.double()).mean()) / (scale or 1.0)


def biased(bias: float) -> str:
    """What a contract violation says of an output ``bias`` steps off on average."""
    return (f"off by {bias:+.2f} steps on average (at most {MAX_BIAS_STEPS} either way: a biased "
            "kernel, e.g. a zero point off by one)")


def remember_example(gm: fx.GraphModule, example_inputs: tuple) -> None:
    """Keep the example inputs of ``prepare_fx`` for the contract check at convert."""
    gm.meta[EXAMPLE_INPUTS] = tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x
                                 for x in example_inputs)


@dataclass
class RegionProbe:
    """What lowering will hand one kernel, noted before any region is lowered (lowering an earlier
    region rewires the later ones' inputs to its kernel, which the reference run never saw)."""

    reference_output: fx.Node
    #: dequantize boundary -> the node producing its integers (as in the reference form)
    sources: dict[fx.Node, fx.Node] = field(default_factory=dict)
    #: the arguments of a float-input kernel, as in the reference form
    call: tuple[tuple, dict] = ((), {})
    #: dequantize boundary -> the float node its integers were quantized from: the lowered model
    #: passes its kernel a tensor laid out as that value (a view, when only views lie between)
    layouts: dict[fx.Node, fx.Node] = field(default_factory=dict)

    def nodes(self) -> list[fx.Node]:
        found: list[fx.Node] = [self.reference_output, *self.sources, *self.sources.values()]
        fx.map_arg(self.call, found.append)
        return found


@dataclass
class ContractRun:
    """Values recorded by running the reference graph once on the example inputs."""

    probes: dict[int, RegionProbe] = field(default_factory=dict)  # by region id
    values: dict[fx.Node, Any] = field(default_factory=dict)
    #: the strides of the probes' ``layouts`` nodes (their values are not kept: one more activation each)
    strides: dict[fx.Node, tuple[int, ...]] = field(default_factory=dict)
    available: bool = False
    #: why the reference form did not run on the example inputs ('' if it ran or had nothing to run)
    failed: str = ""


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (nested tuples, lists and dicts), in order."""
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def _versions(value: Any) -> tuple[int, ...] | None:
    """The version counters of the tensors in ``value`` (each in-place write bumps its tensor's and
    its views'); None when one has none (made under ``torch.inference_mode``)."""
    tensors = tensors_in(value)
    if any(t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


def _copied(value: Any) -> Any:
    return fx.node.map_aggregate(value, lambda v: laid_out_copy(v) if isinstance(v, torch.Tensor) else v)


def laid_out_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides (a column slice stays strided, an expanded tensor expanded):
    a kernel is checked on the layout the model gives it, which ``clone()`` would make contiguous."""
    if tensor.is_quantized:
        return with_strides(tensor.clone(), tensor.stride())
    if tensor.layout != torch.strided:
        return tensor.clone()
    storage = tensor.untyped_storage().clone()
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        storage, tensor.storage_offset(), tensor.size(), tensor.stride())


def with_strides(tensor: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``tensor``'s values laid out with ``stride``, the layout recorded where the model made them:
    kernels can be wrong on one layout only (torch's int8 upsampling and pooling misread a batch-1
    view whose batch stride is not that of a dense tensor). A layout with gaps (a slice) gets its
    dims' order only; so does a quantized tensor with per-channel scales (torch re-strides only
    per-tensor ones)."""
    if tuple(tensor.stride()) == tuple(stride) or tensor.dim() != len(stride) or tensor.dim() == 0:
        return tensor
    order = sorted(range(tensor.dim()), key=lambda d: -stride[d])
    dense = tensor.permute(order).contiguous().permute([order.index(d) for d in range(tensor.dim())])
    per_tensor = not tensor.is_quantized or tensor.qscheme() == torch.per_tensor_affine
    if per_tensor and all(dense.stride(d) == stride[d] for d in range(tensor.dim()) if tensor.size(d) > 1):
        return dense.as_strided(tensor.size(), stride)  # they differ on size-1 dims only
    return dense


class ValueRecorder(fx.Interpreter):
    """Runs a graph, keeping the values of the ``wanted`` nodes in ``values`` as they were when
    produced.

    A later in-place op can overwrite a kept value: in the reference form, ``LeakyReLU(inplace=True)``
    writes into the output of the Dequantize before it, and a kernel checked on that kept value
    got an input activated twice. Copying every value would cost a second copy of the activations,
    so each kept tensor's version counter is noted; the values whose counter moved by the end of
    the run (in-place writes, through views too) are copied when produced in one more run.
    """

    def __init__(self, gm: fx.GraphModule, wanted: set[fx.Node], values: dict[fx.Node, Any],
                 strides: dict[fx.Node, tuple[int, ...]] | None = None) -> None:
        super().__init__(gm)
        self.wanted, self.values = wanted, values
        #: the nodes whose strides alone are kept (filled in by the run: their keys)
        self.strides = strides if strides is not None else {}
        self.copied: set[fx.Node] = set()
        self.versions: dict[fx.Node, tuple[int, ...]] = {}

    def run(self, *args: Any, **kwargs: Any) -> Any:
        result = super().run(*args, **kwargs)
        overwritten = {n for n, v in self.versions.items() if _versions(self.values[n]) != v}
        if not overwritten:
            return result
        self.copied |= overwritten
        self.versions = {}
        return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n in self.strides and isinstance(result, torch.Tensor):
            self.strides[n] = tuple(result.stride())
        if n in self.wanted:
            versions = None if n in self.copied else _versions(result)
            if versions is None:
                self.values[n] = _copied(result)
                self.copied.add(n)
            else:
                self.values[n], self.versions[n] = result, versions
        return result


def record(gm: fx.GraphModule, probes: dict[int, RegionProbe]) -> ContractRun:
    """Run the reference form on the stored example inputs, keeping only the probed values."""
    example = gm.meta.get(EXAMPLE_INPUTS)
    run = ContractRun(probes)
    if example is None or not probes:
        return run
    wanted = {n for p in probes.values() for n in p.nodes()}
    run.strides = {n: () for p in probes.values() for n in p.layouts.values()}
    try:
        with torch.no_grad():
            ValueRecorder(gm, wanted, run.values, run.strides).run(*example)
    except Exception as error:  # noqa: BLE001 - the example no longer fits (a plugin pass changed the graph)
        return ContractRun(probes, failed=f"{type(error).__name__}: {first_line(error)}")
    run.available = True
    return run


def as_float(value: torch.Tensor) -> torch.Tensor:
    """``value`` as a float tensor (a quantized one dequantized)."""
    return value.dequantize() if value.is_quantized else value


def violation(kernel: nn.Module, args: tuple, kwargs: dict, reference: Any, expected_dtype: Any,
              output_scale: float | None) -> str:
    """Why ``kernel(*args, **kwargs)`` breaks the contract against ``reference`` ('' if it holds).
    The kernel gets copies: the recorded values are shared with the other regions' checks, and a
    kernel writing to its input (an in-place ReLU) would change what those checks compare."""
    with native_stderr() as printed:
        try:
            with torch.no_grad():
                out = kernel(*_copied(args), **_copied(kwargs))
        except Exception as error:  # noqa: BLE001 - a raising kernel is a broken kernel
            failure = error
        else:
            failure = None
    if failure is not None:
        return raised(failure, printed)
    echo(printed)
    problem = output_violation(out, reference, expected_dtype, output_scale)
    bias = max((bias_steps(got, want, output_scale) for got, want in zip(as_outputs(out), as_outputs(reference))),
               key=abs, default=0.0)
    return problem or (f"its outputs are {biased(bias)}" if abs(bias) > MAX_BIAS_STEPS else "")


def as_outputs(value: Any) -> list:
    """A module's outputs as a list (one unless it returned a tuple or list)."""
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _structure(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def _grid_steps(out: torch.Tensor, reference: torch.Tensor, step: float | None) -> torch.Tensor | None:
    """How many steps each output is off when both are quantized per tensor on one grid of ``step``:
    the difference of their integers, what :func:`steps_off` gives, without dequantizing either
    (eager convert checks every module's output this way); None otherwise."""
    if step is None or step <= FLOAT_SLACK or not (out.is_quantized and reference.is_quantized):
        return None
    if out.qscheme() != torch.per_tensor_affine or reference.qscheme() != torch.per_tensor_affine:
        return None
    if not (out.q_scale() == reference.q_scale() == step and out.q_zero_point() == reference.q_zero_point()):
        return None
    return (out.int_repr().to(torch.int16) - reference.int_repr().to(torch.int16)).abs()


def output_violation(out: Any, reference: Any, expected_dtype: Any, output_scale: float | None, *,
                     max_outlier_fraction: float = MAX_OUTLIER_FRACTION, min_outliers: int = 0) -> str:
    """Why output ``out`` breaks the contract against ``reference`` ('' if it holds): more than
    ``max_outlier_fraction`` of the elements (and more than ``min_outliers`` of them) off by
    more than MAX_STEPS steps, a channel wrong as a whole (where outliers are counted at all:
    ``max_outlier_fraction < 1``), or a wrong type, shape, dtype or a non-finite value."""
    if isinstance(reference, (tuple, list)):  # a recurrent layer's (output, (h, c)): each checked
        if not isinstance(out, (tuple, list)) or len(out) != len(reference):
            return f"it returned {_structure(out)}, expected {_structure(reference)}"
        for index, (got, want) in enumerate(zip(out, reference)):
            problem = output_violation(got, want, want.dtype if isinstance(want, torch.Tensor) else None,
                                       None, max_outlier_fraction=max_outlier_fraction,
                                       min_outliers=min_outliers)
            if problem:
                return f"output {index}: {problem}"
        return ""
    if not isinstance(out, torch.Tensor) or not isinstance(reference, torch.Tensor):
        return "" if type(out) is type(reference) else \
            f"it returned {type(out).__name__}, expected {type(reference).__name__}"
    if out.shape != reference.shape:
        return f"it returned shape {tuple(out.shape)}, expected {tuple(reference.shape)}"
    if out.dtype != expected_dtype:
        return f"it returned dtype {out.dtype}, expected {expected_dtype}"
    if reference.numel() == 0:
        return ""
    counted = _grid_steps(out, reference, output_scale)
    if counted is not None:
        off, worst = counted > MAX_STEPS, float(counted.max())
    else:
        actual, expected = as_float(out).float(), as_float(reference).float()
        if not torch.isfinite(actual).all():
            return f"it returned {int((~torch.isfinite(actual)).sum())} non-finite value(s)"
        step = output_scale if output_scale else float_step(expected)
        off = steps_off(actual, expected, step) > MAX_STEPS
        worst = float((actual - expected).abs().max() / step)
    if off.float().mean() > max_outlier_fraction and int(off.sum()) > min_outliers:
        return (f"{int(off.sum())} of {off.numel()} outputs differ from the reference by more than "
                f"{MAX_STEPS} quantization steps (up to {worst:.1f})")
    channel = wrong_channel(off) if max_outlier_fraction < 1.0 else None
    if channel is not None:
        dim, index = channel
        return (f"channel {index} (dimension {dim}) is wrong as a whole: "
                f"{int(off.select(dim, index).sum())} of {off.select(dim, index).numel()} of its "
                f"outputs differ from the reference by more than {MAX_STEPS} quantization steps "
                f"(up to {worst:.1f} in the output); a broken kernel, e.g. an int32 bias that overflowed")
    return ""
