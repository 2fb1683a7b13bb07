"""Layer-by-layer parity of a compiling backend with the reference form (teacher forcing).

Comparing an int8 model's output with its reference form measures the model as much as the
backend: in a deep random-weight residual net one value that rounds the other way (float32
accumulation order against an exact int32 sum) changes the next layer's inputs, and the
difference grows layer after layer. On the zoo's ResNet-50, fbgemm's own kernels agree with the
reference form within one step on only ~77-80% of the outputs, and even the reference form run in
float64 instead of float32 does not agree with itself better. So here every int8 region (the
nodes from the integer values it reads to the integer value it writes) is run by the backend on
the reference form's own integer inputs, and its integer output is compared with the reference's:
each region is checked alone, as a kernel test would check it. A weighted op on int8 inputs whose
output stays float (``BackendSpec.float_outputs``: no int8 op reads it) ends a region too; its
float output is compared in steps of its range / 255, as the kernel contract counts float outputs.

All regions go into one side-by-side graph (each with its own inputs), compiled once (an ONNX
model of it is cut from the partition's where that was exported: ``onnx_export/region_models.py``).

It lives in the pipeline because convert runs it too: a delegated partition of several int8
regions is checked region by region this way on the example inputs (``flows/delegate.py``);
the plugin testing kit re-exports it (``plugin_api.layer_parity``) for a backend's own tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from qplug_core.errors import PluginContractError
from qplug_core.flows.kernel_check import (
    MAX_BIAS_STEPS,
    MAX_STEPS,
    ValueRecorder,
    biased,
    float_step,
    signed_steps,
    steps_off,
    wrong_channel,
)
from qplug_core.flows.tags import CHECK_REGIONS
from qplug_core.kernels.reference import Dequantize, Quantize, ReferenceWeighted
from qplug_core.partition import OperatorSupportBase

__all__ = ["REGION_MIN_WITHIN", "LayerParity", "RegionParity", "is_float_output", "layer_parity", "region_of",
           "reusing_exports"]

#: a region must agree with the reference within ``steps`` on at least this fraction of its
#: elements (ORT and OpenVINO: 100% on every zoo model)
REGION_MIN_WITHIN = 0.99

_INTEGER = (torch.uint8, torch.int8, torch.int16, torch.int32)


#: partition id -> what a serializer exported for it, kept for its check graph (by
#: ``onnx_export/region_models.py``), while :func:`reusing_exports` is in force
_EXPORTS: ContextVar[dict[int, Any] | None] = ContextVar("partition_exports", default=None)


@contextmanager
def reusing_exports() -> Iterator[None]:
    """The check graphs compiled in this block may be cut from what their partition's compile
    exported in it (one export of the partition instead of two); all of it is let go at its end."""
    token = _EXPORTS.set({})
    try:
        yield
    finally:
        _EXPORTS.reset(token)


def partition_exports() -> dict[int, Any] | None:
    """The exports :func:`reusing_exports` keeps (None outside it)."""
    return _EXPORTS.get()


@dataclass(frozen=True)
class RegionParity:
    """How one int8 region's backend output compares with the reference form's."""

    name: str  # the node writing the region's integer output
    elements: int
    within: float  # fraction of elements within ``steps`` integer steps
    max_steps: int
    #: (dimension, index) of a channel mostly beyond the kernel contract's MAX_STEPS, or None
    wrong_channel: tuple[int, int] | None = None
    #: mean signed difference in steps: rounding ties go both ways, a zero-point off by one does not
    bias: float = 0.0

    def problem(self, steps: int) -> str:
        """Why this region breaks the contract at ``steps`` ('' if it holds): under
        REGION_MIN_WITHIN of its elements within ``steps``, a channel wrong as a whole, or a mean
        signed error beyond MAX_BIAS_STEPS (one step off everywhere is within one step everywhere)."""
        if self.within >= REGION_MIN_WITHIN and self.wrong_channel is None and abs(self.bias) <= MAX_BIAS_STEPS:
            return ""
        channel = "" if self.wrong_channel is None else (
            f"; its channel {self.wrong_channel[1]} (dimension {self.wrong_channel[0]}) is wrong as a whole, "
            f"beyond {MAX_STEPS} steps on most elements")
        return (f"int8 region {self.name}, compiled alone on the reference's own inputs, is within {steps} step of "
                f"the reference on {self.within:.1%} of its {self.elements} elements (needs {REGION_MIN_WITHIN:.0%}; "
                f"up to {self.max_steps} steps){channel}"
                + (f"; {biased(self.bias)}" if abs(self.bias) > MAX_BIAS_STEPS else ""))


@dataclass(frozen=True)
class LayerParity:
    regions: tuple[RegionParity, ...]
    steps: int

    @property
    def within(self) -> float:
        """Fraction of all regions' elements within ``steps`` integer steps."""
        total = sum(r.elements for r in self.regions)
        return sum(r.within * r.elements for r in self.regions) / total if total else 1.0

    @property
    def worst(self) -> RegionParity:
        return min(self.regions, key=lambda r: r.within)

    @property
    def problems(self) -> dict[str, str]:
        """Why each region that breaks the contract does (:meth:`RegionParity.problem`), worst first."""
        return {r.name: why for r in sorted(self.regions, key=lambda r: r.within) if (why := r.problem(self.steps))}

    @property
    def ok(self) -> bool:
        """Whether every region keeps the contract convert holds compiled regions to."""
        return not self.problems

    def assert_ok(self) -> None:
        """Raise :class:`PluginContractError` naming each region that breaks the contract (a
        backend's parity test: ``within`` alone passes a region one step off on every element)."""
        if self.problems:
            raise PluginContractError(f"{len(self.problems)} of {len(self.regions)} int8 region(s) break the "
                                      "kernel contract: " + "; ".join(self.problems.values()))


def _is_integer_output(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), Quantize)


def is_float_output(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A weighted op reading a dequantized int8 value whose output no Quantize takes (a backend's
    ``float_outputs``: the report names them, ``flows/finish.py``)."""
    if not (node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), ReferenceWeighted)):
        return False
    source = node.args[0] if node.args else None
    return (isinstance(source, fx.Node) and source.op == "call_module"
            and isinstance(gm.get_submodule(str(source.target)), Dequantize)
            and not any(_is_integer_output(gm, user) for user in node.users))


def region_of(gm: fx.GraphModule, end: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(boundary inputs, nodes in graph order) of the region writing ``end``: its nodes back to
    the integer values (or model inputs) it reads, and to the float outputs of int8 ops, which
    end regions of their own: through them a region after a float residual stream took in every
    int8 op before it (each quantize after a Wav2Vec2 LayerNorm held OpenVINO's wrong grouped
    positional conv, and was blamed for its error)."""
    inputs: set[fx.Node] = set()
    members: set[fx.Node] = set()
    stack = [end]
    while stack:
        node = stack.pop()
        if node in members:
            continue
        members.add(node)
        for arg in node.all_input_nodes:
            if arg.op == "placeholder" or _is_integer_output(gm, arg) or is_float_output(gm, arg):
                inputs.add(arg)
            elif arg.op != "get_attr":
                stack.append(arg)
            else:
                members.add(arg)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(inputs, key=order.__getitem__), sorted(members, key=order.__getitem__)


def _side_by_side(gm: fx.GraphModule, regions: list[tuple[list[fx.Node], list[fx.Node]]]) -> fx.GraphModule:
    graph = fx.Graph()
    outputs = []
    for i, (inputs, members) in enumerate(regions):
        env: dict[fx.Node, fx.Node] = {n: graph.placeholder(f"r{i}_{n.name}") for n in inputs}
        for node in members:
            env[node] = graph.node_copy(node, env.__getitem__)
        outputs.append(env[members[-1]])
    graph.output(tuple(outputs))
    check = fx.GraphModule(gm, graph)
    check.meta[CHECK_REGIONS] = (gm, [([n.name for n in inputs], members[-1].name) for inputs, members in regions])
    return check


def _compare(name: str, got: object, want: torch.Tensor, steps: int) -> RegionParity:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        what = f"shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        raise PluginContractError(f"int8 region {name}: the compiled module returned {what}, expected shape "
                                  f"{tuple(want.shape)}")
    if want.is_floating_point():  # in steps of the output's range / 255, as the kernel contract
        step = float_step(want)
        signed = signed_steps(got, want, step)
        diff = steps_off(got, want, step)
    else:
        signed = (got.to(torch.int64) - want.to(torch.int64)).double()
        diff = signed.abs().to(torch.int64)
    within = float((diff <= steps).float().mean()) if diff.numel() else 1.0
    return RegionParity(name, diff.numel(), within, int(diff.max()) if diff.numel() else 0,
                        wrong_channel(diff > MAX_STEPS), float(signed.mean()) if diff.numel() else 0.0)


@torch.no_grad()
def layer_parity(reference: fx.GraphModule,
                 compile: Callable[[fx.GraphModule, tuple[torch.Tensor, ...]], nn.Module],
                 inputs: tuple, *, operator_support: OperatorSupportBase | None = None,
                 steps: int = 1) -> LayerParity:
    """Run every int8 region of ``reference`` (a ``convert_to_reference_fx`` model) through
    ``compile`` (a delegate's compile function) on the reference's own integer inputs for
    ``inputs``, and compare the integer outputs (float ones in steps of their range / 255).
    Regions holding a node ``operator_support`` refuses are left out (the backend does not run
    them)."""
    values: dict[fx.Node, object] = {}
    ValueRecorder(reference, set(reference.graph.nodes), values).run(*inputs)
    submodules = dict(reference.named_modules())
    regions, ends = [], []
    for node in reference.graph.nodes:
        value = values.get(node)
        if not isinstance(value, torch.Tensor) or not (
                (_is_integer_output(reference, node) and value.dtype in _INTEGER)
                or is_float_output(reference, node)):
            continue
        region_inputs, members = region_of(reference, node)
        if operator_support is not None and not all(
                operator_support.is_node_supported(submodules, n) for n in members if n.op != "get_attr"):
            continue
        regions.append((region_inputs, members))
        ends.append(node)
    if not regions:
        return LayerParity((), steps)
    example = tuple(values[n] for region_inputs, _ in regions for n in region_inputs)
    compiled = compile(_side_by_side(reference, regions), example)
    outputs = compiled(*example)
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return LayerParity(tuple(_compare(end.name, got, values[end], steps)
                             for end, got in zip(ends, outputs)), steps)
