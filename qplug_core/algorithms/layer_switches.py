"""Weighted layers as switches between float and int8, so a sensitivity ranking runs one forward
pass per layer and side instead of one quantization.

In the reference form (q/dq around float ops) a layer is int8 where it reads its input through a
quantize/dequantize pair, computes with rounded weights and hands its output to the next pair.
:func:`with_switches` rewrites every call of the chosen layers to a :class:`LayerSwitch` that
holds those pairs, the rounded module and the float one. In the float graph (every other op
float) a switch turned int8 applies all three: the layer alone int8. In the reference form
(every other op int8) a switch turned float runs the float weights and drops the pairs that exist
only for this layer, as a quantization with the layer left float would: the pair of its input
or output when no other op that reads or produces that value is int8 (prepare's region tags say
which are). The rest stay, since int8 neighbours still need them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import fx, nn

from qplug_core.flows.tags import region_tag
from qplug_core.kernels.reference import Dequantize, Quantize

__all__ = ["LayerSwitch", "flipped", "with_switches"]


@dataclass(frozen=True)
class _Pair:
    """A quantize/dequantize pair of the reference form: what it rounds and how."""

    value: fx.Node  # the node whose value it rounds
    quantize: Quantize
    dequantize: Dequantize
    users: list[fx.Node]  # what reads the dequantized value
    dequantized: str  # the dequantize node's name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequantize(self.quantize(x))


def _pair_reading(reference: fx.GraphModule, dq: object) -> _Pair | None:
    """The pair whose dequantize node is ``dq``, if it is one."""
    if not (isinstance(dq, fx.Node) and dq.op == "call_module"
            and isinstance(reference.get_submodule(dq.target), Dequantize)):
        return None
    q = dq.args[0]
    if not (isinstance(q, fx.Node) and q.op == "call_module" and len(q.users) == 1
            and isinstance(reference.get_submodule(q.target), Quantize) and isinstance(q.args[0], fx.Node)):
        return None
    return _Pair(q.args[0], reference.get_submodule(q.target), reference.get_submodule(dq.target),
                 list(dq.users), dq.name)


def _pair_after(reference: fx.GraphModule, node: fx.Node) -> _Pair | None:
    users = list(node.users)
    if len(users) != 1 or users[0].op != "call_module" \
            or not isinstance(reference.get_submodule(users[0].target), Quantize):
        return None
    return _pair_reading(reference, next(iter(users[0].users), None))


@dataclass(frozen=True)
class _Call:
    """One call of a layer in the reference form and what a float layer there would drop."""

    inputs: _Pair | None
    output: _Pair | None
    own_input: bool  # the input's pair exists for this layer alone
    own_output: bool  # the output's pair exists for this layer alone


def _int8(node: fx.Node) -> bool:
    """Whether prepare quantized ``node``'s op (its region tag)."""
    tag = region_tag(node)
    return tag is not None and tag.quantized


def _call(reference: fx.GraphModule, node: fx.Node) -> _Call:
    """A value keeps its pair when its producer or another reader is int8 (an int8 op emits and
    reads int8), as prepare would observe it with this layer float."""
    inputs = _pair_reading(reference, node.args[0] if node.args else None)
    output = _pair_after(reference, node)
    own_input = inputs is not None and not _int8(inputs.value) and not any(
        _int8(u) for u in inputs.users if not (u.op == "call_module" and u.target == node.target))
    own_output = output is not None and not any(_int8(u) for u in output.users)
    return _Call(inputs, output, own_input, own_output)


class LayerSwitch(nn.Module):
    """One call of a weighted layer: float, or int8 (input and output on their grids, rounded
    weights). ``float_pairs`` (reference form): the float side keeps the pairs not its own."""

    def __init__(self, float_module: nn.Module, int8_module: nn.Module, call: _Call, *, int8: bool,
                 float_pairs: bool) -> None:
        super().__init__()
        self.float_module, self.int8_module, self.call, self.int8 = float_module, int8_module, call, int8
        self.float_pairs = float_pairs

    def forward(self, x, *args, **kwargs):
        call = self.call
        if self.int8:
            x = call.inputs(x) if call.inputs is not None else x
            y = self.int8_module(x, *args, **kwargs)
            return call.output(y) if call.output is not None else y
        if self.float_pairs and call.inputs is not None and not call.own_input:
            x = call.inputs(x)
        y = self.float_module(x, *args, **kwargs)
        if self.float_pairs and call.output is not None and not call.own_output:
            y = call.output(y)
        return y


def _calls(gm: fx.GraphModule, layers: list[str]) -> dict[str, list[fx.Node]]:
    wanted = set(layers)
    calls: dict[str, list[fx.Node]] = {name: [] for name in layers}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in wanted:
            calls[node.target].append(node)
    return calls


def with_switches(target: fx.GraphModule, reference: fx.GraphModule, float_gm: fx.GraphModule,
                  layers: list[str], *, int8: bool) -> tuple[fx.GraphModule, dict[str, list[LayerSwitch]]]:
    """(``target``'s graph with each call of ``layers`` a switch set to ``int8``, the switches by layer).

    ``target`` is ``reference`` (the reference form) or ``float_gm`` (the fused float graph it was
    converted from: the same layer calls in the same order). Each switch takes its pairs and
    rounded module from ``reference``'s call and its float module from ``float_gm``; ``target`` is
    not modified (the result shares its modules)."""
    result = fx.GraphModule(target, copy.deepcopy(target.graph))  # the same node names
    in_reference = target is reference
    calls = {name: [_call(reference, n) for n in nodes] for name, nodes in _calls(reference, layers).items()}
    now = {n.name: n for n in result.graph.nodes}  # node name -> its node, or what replaced it
    switches: dict[str, list[LayerSwitch]] = {}
    for i, (name, nodes) in enumerate(_calls(result, layers).items()):
        for k, node in enumerate(nodes):
            call = (calls[name][k:k + 1] or [_Call(None, None, False, False)])[0]
            switch = LayerSwitch(float_gm.get_submodule(name), reference.get_submodule(name), call,
                                 int8=int8, float_pairs=in_reference)
            path = f"sensitivity_switch_{i}_{k}"
            result.add_submodule(path, switch)
            # in the reference form the switch reads the value before its input's pair and
            # stands for its output's pair: it applies them itself
            x = now[call.inputs.value.name] if in_reference and call.inputs is not None else node.args[0]
            with result.graph.inserting_before(node):
                replaced = result.graph.call_module(path, (x, *node.args[1:]), dict(node.kwargs))
            node.replace_all_uses_with(replaced)
            result.graph.erase_node(node)
            now[node.name] = replaced
            if in_reference and call.output is not None:
                now[call.output.dequantized].replace_all_uses_with(replaced)
            switches.setdefault(name, []).append(switch)
    result.graph.eliminate_dead_code()  # the pairs only switched layers read
    result.recompile()
    return result, switches


@contextmanager
def flipped(switches: list[LayerSwitch]) -> Iterator[None]:
    """``switches`` the other way while the block runs."""
    for switch in switches:
        switch.int8 = not switch.int8
    try:
        yield
    finally:
        for switch in switches:
            switch.int8 = not switch.int8
