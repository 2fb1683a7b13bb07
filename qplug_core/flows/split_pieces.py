"""``chunk`` / ``split`` (CSP and C2f blocks): one int8 tensor cut into pieces that keep its qparams.

Their output is a tuple, which no observer or quantize can hold, so the op shares its input's
observer without one of its own; each ``pieces[i]`` read shares the same observer after it, and
lowering runs the op on the int8 tensor and drops the quantize after each read. A split whose
pieces are used otherwise (the whole tuple given to ``torch.cat``) stays float, with the reason.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

SPLITS = (torch.chunk, torch.split, "chunk", "split")
NOT_READ_BY_INDEX = ("its pieces are not each read with a constant index (pieces[0]), so the int8 tensor "
                     "cannot be cut without dequantizing it")


def is_split(node: fx.Node) -> bool:
    if node.op == "call_function":
        return any(node.target is op for op in SPLITS if not isinstance(op, str))
    return node.op == "call_method" and node.target in ("chunk", "split")


def read_by_index(node: fx.Node) -> bool:
    """Whether every use of the split ``node`` is ``node[i]`` with a constant int ``i``."""
    return bool(node.users) and all(
        user.op == "call_function" and user.target is operator.getitem and user.args[0] is node
        and isinstance(user.args[1], int) for user in node.users)


def split_of(node: fx.Node) -> fx.Node | None:
    """The split whose piece ``node`` reads (``pieces[i]`` of a split read only that way), else None."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    source = node.args[0]
    if isinstance(source, fx.Node) and is_split(source) and read_by_index(source):
        return source
    return None
