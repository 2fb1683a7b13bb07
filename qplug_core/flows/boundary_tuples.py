"""Tuples crossing into a partition are unpacked at its boundary: partitions take tensors only.

A compiled partition is a serialized model whose inputs are tensors. An LSTM decoder fed the
encoder's ``(h, c)`` state (``_, state = enc(x); dec(y, state)``, the encoder left in PyTorch
because its tuple is used as a whole) made a partition whose input was that tuple, and its
compile failed (``'tuple' object has no attribute 'shape'``): the decoder and everything after it
ran in reference form. So a partition reading a tuple made outside it reads its tensors instead:
an ``x[k]`` of it moves out of the partition (it only selects), and an LSTM taking the tuple as its
state takes ``(state[0], state[1])``, indexed outside. The plan depends on the graph alone, so
``qp.load`` makes the same partitions.
"""

from __future__ import annotations

import operator

from torch import fx, nn

from qplug_core.flows.tags import VALUE_KIND
from qplug_core.kernels.reference import ReferenceRecurrent

#: where an ``nn.LSTM`` call takes its ``(h, c)`` state: its second argument
_LSTM_STATE = 1


def _is_lstm(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op != "call_module":
        return False
    module = gm.get_submodule(str(node.target))
    return isinstance(module.module if isinstance(module, ReferenceRecurrent) else module, nn.LSTM)


def _unpacked_state(gm: fx.GraphModule, state: fx.Node) -> tuple[fx.Node, fx.Node]:
    """``(state[0], state[1])``, indexed right after ``state`` (outside any partition)."""
    with gm.graph.inserting_after(state):
        c = gm.graph.call_function(operator.getitem, (state, 1))
    with gm.graph.inserting_after(state):
        h = gm.graph.call_function(operator.getitem, (state, 0))
    for node in (h, c):
        node.meta[VALUE_KIND] = "float_tensor"
    return h, c


def unpack_boundary_tuples(gm: fx.GraphModule, partitions: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """``partitions`` (nodes in graph order) with no input that is a tuple made outside them, in
    place on ``gm`` (see the module docstring); run after the ints crossing a boundary were copied
    (``flows/shape_ints.py``), so what is left of the values that are not tensors are tuples."""
    members = [list(nodes) for nodes in partitions]
    moved = True
    while moved:  # an index moved out may read a tuple of tuples: its readers are looked at again
        moved = False
        for nodes in members:
            inside = set(nodes)
            for node in list(nodes):
                tuples = [a for a in node.all_input_nodes if a not in inside and a.meta.get(VALUE_KIND) == "other"]
                if not tuples:
                    continue
                if node.op == "call_function" and node.target is operator.getitem:
                    nodes.remove(node)
                    inside.discard(node)
                    moved = True
                elif _is_lstm(gm, node) and len(node.args) > _LSTM_STATE and node.args[_LSTM_STATE] in tuples:
                    args = list(node.args)
                    args[_LSTM_STATE] = _unpacked_state(gm, node.args[_LSTM_STATE])
                    node.args = tuple(args)
    return members


__all__ = ["unpack_boundary_tuples"]
