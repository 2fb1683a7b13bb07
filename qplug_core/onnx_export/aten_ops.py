"""ONNX translations of ATen ops whose torchlib translation a partition cannot use.

* ``scatter_reduce(reduce="mean")``: torchlib writes a plain ScatterElements (no division, the
  sum's last write wins), so segment mean pooling, a GNN's usual readout, computed wrong numbers
  in ONNX Runtime and OpenVINO and the partition's int8 layers all fell back to reference form.
  Here it is the sum of the values and the count of each target, then their quotient, with
  torch's ``include_self`` and its rules for targets nothing is scattered to (they keep ``self``)
  and for integers (floor division).
* ``gather`` with an index smaller than the input in a dimension other than ``dim`` (top-k box
  decoding: ``p.gather(1, idx.unsqueeze(-1).expand(-1, -1, 4))`` with ``p`` of 9 features):
  torch reads only the index's extent there, and OpenVINO refuses a GatherElements whose shapes
  differ outside the axis, which failed the whole partition. The input is cut to the index's
  extent first; where the shapes already agree the export is torchlib's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from onnxscript import ir
from onnxscript.function_libs.torch_lib.ops.core import aten_gather, aten_scatter_reduce
from onnxscript.onnx_opset import opset18 as op

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _cut_to_index(data, index, axes: Sequence[int]):
    """``data`` cut to ``index``'s extent along each of ``axes`` (torch reads no further) unless
    they are the same size there (the same number, or the same named symbolic size). A Gather of
    ``range(size)``, not a Slice: OpenVINO 2026.4 drops a Slice in front of GatherElements and then
    refuses the shapes again."""
    sizes = data.shape
    for axis in axes:
        size = sizes[axis]
        if not (size == index.shape[axis] and (isinstance(size, int) or size.value is not None)):
            extent = op.Gather(op.Shape(index), op.Constant(value_int=axis), axis=0)
            data = op.Gather(data, op.Range(op.Constant(value_int=0), extent, op.Constant(value_int=1)),
                             axis=axis)
    return data


def gather(self, dim: int, index, sparse_grad: bool = False):
    rank = len(self.shape)
    if rank == 0 or len(index.shape) == 0:  # torchlib's handling of scalars
        return aten_gather(self, dim, index, sparse_grad)
    dim %= rank
    data = _cut_to_index(self, index, [a for a in range(rank) if a != dim])
    return op.GatherElements(data, op.Cast(index, to=ir.DataType.INT64), axis=dim)


def scatter_reduce(self, dim: int, index, src, reduce: str, include_self: bool = True):
    if reduce != "mean":  # torchlib's translation is right for the others
        return aten_scatter_reduce(self, dim, index, src, reduce, include_self)
    dtype = self.dtype
    scalar = len(self.shape) == 0
    if scalar:  # ScatterElements takes rank >= 1 (index and src are scalars too)
        flat = op.Constant(value_ints=[1])
        self, index, src = op.Reshape(self, flat), op.Reshape(index, flat), op.Reshape(src, flat)
    else:
        dim %= len(self.shape)
        src = _cut_to_index(src, index, range(len(index.shape)))
    zeros = op.ConstantOfShape(op.Shape(index), value=ir.tensor(np.zeros(1, dtype=dtype.numpy())))
    ones = op.ConstantOfShape(op.Shape(index), value=ir.tensor(np.ones(1, dtype=dtype.numpy())))
    start = self if include_self else op.ScatterElements(self, index, zeros, axis=dim)
    total = op.ScatterElements(start, index, src, axis=dim, reduction="add")
    first = op.ConstantOfShape(op.Shape(self), value=ir.tensor(np.array([int(include_self)], dtype=dtype.numpy())))
    # targets nothing reaches count 0 and keep ``self`` (their total): divided by 1
    count = op.Max(op.ScatterElements(first, index, ones, axis=dim, reduction="add"), op.CastLike(1, self))
    if dtype not in _FLOATS:
        total = op.Sub(total, op.Mod(total, count))  # a multiple of count: floor division, as torch's
    mean = op.Div(total, count)
    return op.Squeeze(mean) if scalar else mean


def translation_table() -> dict[Callable, Callable]:
    """These translations, for ``torch.onnx.export``'s ``custom_translation_table``."""
    aten = torch.ops.aten
    return {aten.scatter_reduce.two: scatter_reduce, aten.gather.default: gather}


__all__ = ["gather", "scatter_reduce", "translation_table"]
