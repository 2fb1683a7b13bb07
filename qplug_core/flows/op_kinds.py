"""Which float-left ops could have been int8: compute ops, against shape and integer plumbing.

The value kind recorded when the model ran on its example inputs decides first: an op whose value
is not a float tensor (a size, an integer mask, a tuple of tensors) computes nothing int8 could
take. Among float values, ops that only move or view data (``view``, ``slice``, ``expand``,
``permute``, ...) are plumbing too: int8 flows through them unchanged when its neighbours are
int8, and alone they have nothing to gain.
"""

from __future__ import annotations

#: an op computing on float values: the ones a user reading "left in float" wants to see
COMPUTE = "compute"
#: an op that moves, views or measures data (its value is float or a size)
SHAPE = "shape"
#: an op on integer (or other non-float) values: token ids, masks, sizes, tuples
INTEGER = "integer"

#: ops that only move, view, index or measure data (ATen and torch spellings, overload stripped)
DATA_MOVEMENT = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "expand_as", "slice", "select", "narrow",
    "getitem", "getattr", "size", "sym_size", "sym_numel", "sym_stride", "dim", "numel",
    "permute", "transpose", "t", "contiguous", "unsqueeze", "squeeze", "flatten", "unflatten",
    "split", "split_with_sizes", "chunk", "unbind", "clone", "alias", "detach", "to", "type_as",
    "_to_copy", "lift_fresh_copy", "gather", "index", "index_select", "repeat", "tile", "cat",
    "stack", "arange", "full", "ones", "zeros", "empty", "new_ones", "new_zeros", "full_like",
    "ones_like", "zeros_like", "scalar_tensor", "_assert_tensor_metadata",
    "_assert_scalar", "sym_constrain_range_for_size", "dropout",
})


def base_name(op: str) -> str:
    """``slice.Tensor`` -> ``slice``, ``aten::view`` -> ``view``, ``expand_`` -> ``expand``."""
    return op.rsplit("::", 1)[-1].split(".", 1)[0].rstrip("_") or op


def op_kind(value_kind: str | None, op: str, float_weights: bool = False) -> str:
    """:data:`COMPUTE`, :data:`SHAPE` or :data:`INTEGER` for a node left in float: ``value_kind``
    is what it computed on the example inputs ("float_tensor", "tensor", "other", or ``None``
    when not recorded), ``op`` what the report calls it (a module class or a function name);
    a module holding ``float_weights`` computes whatever it returns (an LSTM's tuple)."""
    if float_weights:
        return COMPUTE
    kind = value_kind
    if kind is not None and kind != "float_tensor":
        return SHAPE if kind == "other" and base_name(op) in DATA_MOVEMENT else INTEGER
    return SHAPE if base_name(op) in DATA_MOVEMENT else COMPUTE
