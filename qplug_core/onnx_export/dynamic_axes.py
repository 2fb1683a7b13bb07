"""Dynamic batch (and sequence) axes for ONNX export.

``torch.onnx.export`` gives every input the example's static shape unless told which axes vary.
``export_onnx(..., dynamic_batch=True)`` makes axis 0 of every tensor input the symbolic dimension
``batch``, and ``dynamic_sequence=True`` axis 1 of every input of rank 2 or more ``sequence``
(token ids and masks of token models); ``dynamic_axes={axis: name}`` names any others (the time
axis 2 of a ``(batch, channels, time)`` input). torch.export specialises an axis the example has at size 1
(0/1 specialisation), so such an example is widened to 2 along it first. When the graph fixes an
axis anyway (a reshape to a literal size), export fails, or the axis stays static: both are an
:class:`ExportError` naming the input, never a model that silently takes one size only.

A compiled partition wants the opposite trade (:func:`flexible_shapes`): every axis of its
inputs symbolic *where the graph leaves it free* (batch, sequence, the time axis of a
``(batch, channels, time)`` signal, an image's height and width) and every axis the graph fixes
the example's, so one runtime session serves every size instead of one session per shape (a
session per new audio length cost seconds and ~7 MB each). A symbolic axis keeps the smallest
size the graph takes (a kernel-3 convolution: 3) in the model's metadata (:data:`MIN_SIZES`,
:class:`InputShapes`). An axis of size 1 stays static (torch.export would specialise it anyway),
so which session answers an input depends on its shapes only, never on the order of the calls.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qplug_core.errors import ExportError
from qplug_core.ir.failed_calls import quiet_call

BATCH, SEQUENCE = "batch", "sequence"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def dynamic_axes(batch: bool, sequence: bool, named: Mapping[int, str] | None = None) -> dict[int, str]:
    """``{axis: name}`` asked for by ``export_onnx``'s flags and its ``dynamic_axes`` (``named``),
    checked: axes are ints >= 0, names non-empty strings, one name per axis and one axis per name
    (a name shared by two axes would tie their sizes)."""
    axes = {axis: name for axis, name, wanted in ((0, BATCH, batch), (1, SEQUENCE, sequence)) if wanted}
    if named is None:
        return axes
    if not isinstance(named, Mapping):
        raise ExportError(f"dynamic_axes takes {{axis: name}} for every input, e.g. {{0: 'batch', 2: 'time'}}, "
                          f"got {type(named).__name__}")
    for axis, name in named.items():
        if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
            raise ExportError(f"dynamic_axes takes {{axis: name}} for every input (an axis is an int >= 0), e.g. "
                              f"{{0: 'batch', 2: 'time'}}, got the key {axis!r} (torch.onnx's per-input form "
                              "{input: {axis: name}} is not taken: every input of enough rank gets the axes)")
        if not isinstance(name, str) or not name:
            raise ExportError(f"dynamic_axes: axis {axis} needs a name (a non-empty str), got {name!r}")
        if axes.get(axis, name) != name:
            raise ExportError(f"dynamic_axes names axis {axis} {name!r}, but "
                              f"{'dynamic_batch' if axes[axis] == BATCH else 'dynamic_sequence'} names it "
                              f"{axes[axis]!r}: ask for it once")
        axes[axis] = name
    names = list(axes.values())
    shared = sorted({name for name in names if names.count(name) > 1})
    if shared:
        raise ExportError(f"dynamic_axes gives the name(s) {shared} to more than one axis, which would tie their "
                          "sizes; give every axis its own name")
    return dict(sorted(axes.items()))


def described(axes: Mapping[int, str]) -> str:
    """``batch (axis 0) and time (axis 2)``: the asked-for axes as an error names them."""
    return " and ".join(f"{name} (axis {axis})" for axis, name in axes.items())


def prepare(example_inputs: tuple, axes: dict[int, str]) -> tuple[tuple, tuple[Any, ...]]:
    """The example inputs to export with (widened to 2 along a size-1 dynamic axis) and the
    ``dynamic_shapes`` of ``torch.onnx.export`` (axis -> name per tensor input, made unique per
    input; :func:`untie` gives the names asked for back)."""
    inputs, shapes = [], []
    tensors = 0
    for value in example_inputs:
        if not isinstance(value, torch.Tensor):
            inputs.append(value)
            shapes.append(None)
            continue
        mine = {axis: f"{name}{_OF_INPUT}{tensors}" for axis, name in axes.items() if axis < value.dim()}
        tensors += 1
        for axis in mine:
            if value.shape[axis] == 1:
                value = torch.cat([value] * 2, dim=axis)
        inputs.append(value)
        shapes.append(mine or None)
    return tuple(inputs), tuple(shapes)


#: the ONNX metadata key of the smallest size of each symbolic input axis (JSON ``{name: size}``)
MIN_SIZES = "qplug.min_sizes"


def flexible_shapes(example_inputs: tuple, free: Sequence[set[int]] | None = None) -> tuple[Any, ...]:
    """``dynamic_shapes`` letting torch.export decide every axis of size >= 2 of every tensor
    input (``Dim.AUTO``: symbolic where the graph allows, the example's size where it fixes it),
    or only those ``free`` names (axes by input position: :func:`free_axes`)."""
    from torch.export import Dim

    return tuple({axis: Dim.AUTO for axis in range(value.dim())
                  if value.shape[axis] >= 2 and (free is None or axis in free[position])}
                 or None if isinstance(value, torch.Tensor) else None for position, value in enumerate(example_inputs))


def _user_input_sizes(exported_program):
    """The sizes of every user input axis of ``exported_program`` (ints, or sympy expressions)."""
    import sympy

    for spec in exported_program.graph_signature.input_specs:
        if spec.kind.name != "USER_INPUT":
            continue
        node = next(n for n in exported_program.graph.nodes if n.name == spec.arg.name)
        for size in getattr(node.meta.get("val"), "shape", ()):
            yield size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def pinned_sizes(exported_program) -> dict[str, int]:
    """Symbols of input axes that ``Dim.AUTO`` left symbolic but bounded to one value (a conv's
    channels: ``s50`` in ``[64, 64]``), by name: static sizes in all but name."""
    ranges = exported_program.range_constraints
    pinned = {}
    for expr in _user_input_sizes(exported_program):
        bounds = ranges.get(expr)
        if not expr.is_number and bounds is not None and bounds.lower == bounds.upper:
            pinned[str(expr)] = int(bounds.lower)
    return pinned


def free_symbols_only(exported_program) -> bool:
    """Whether every symbolic input axis of ``exported_program`` is a free size (a plain symbol
    valid for every size from a lower bound up: :func:`min_sizes`) or a pinned one
    (:func:`pinned_sizes`). A size the graph derives from another (``2*s0``) or bounds from above
    is not something ONNX input shapes can say, so such a partition is exported with static
    shapes instead."""
    import sympy
    from torch.utils._sympy.numbers import int_oo

    ranges, pinned = exported_program.range_constraints, pinned_sizes(exported_program)
    for expr in _user_input_sizes(exported_program):
        if expr.is_number or str(expr) in pinned:
            continue
        bounds = ranges.get(expr)
        if not isinstance(expr, sympy.Symbol) or bounds is None or bounds.upper not in (int_oo, sympy.oo):
            return False
    return True


def free_axes(gm, example_inputs: tuple) -> list[set[int]]:
    """The axes of size >= 2 of each input (by position) the reference form ``gm`` also takes at
    twice the size, found before it is exported so that one export suffices: torch.export leaves
    a flatten's axes symbolic before a linear that fixes their product (no guard), and a runtime
    then fails, or computes garbage, at any other size (finding that after the export exported
    the digits CNN twice). One run doubles every axis (the usual case: all free); where that
    fails, the axes of each size are doubled together (the graph may tie them: a mask's batch to
    the tokens'), and where that fails, those of each axis index; a run that fails stops at the
    op that fixes the size (a conv's channels: its first layer)."""
    places = [(position, axis) for position, value in enumerate(example_inputs) if isinstance(value, torch.Tensor)
              for axis in range(value.dim()) if value.shape[axis] >= 2]

    def takes(doubled_places: list[tuple[int, int]]) -> bool:
        doubled = list(example_inputs)  # twice the size keeps a stride's ratio between sizes
        for position, axis in doubled_places:
            doubled[position] = torch.cat([doubled[position]] * 2, dim=axis)
        try:  # quietly: torch.fx prints each failed call's generated code on stderr (a ViT: 10 times)
            with torch.no_grad():
                quiet_call(gm, tuple(doubled))
        except Exception:  # noqa: BLE001 - any failure: the graph does not take those sizes
            return False
        return True

    def grouped(group: list[tuple[int, int]], key: Callable[[tuple[int, int]], int]) -> list[list[tuple[int, int]]]:
        groups: dict[int, list[tuple[int, int]]] = {}
        for place in group:
            groups.setdefault(key(place), []).append(place)
        return list(groups.values())

    found = [places]
    if places and not takes(places):
        found = []
        for group in grouped(places, lambda place: example_inputs[place[0]].shape[place[1]]):
            if takes(group):
                found.append(group)
            elif len(by_axis := grouped(group, lambda place: place[1])) > 1:
                found += [axes for axes in by_axis if takes(axes)]
        if len(found) > 1 and not takes([place for group in found for place in group]):
            found = []  # free one at a time but not together (a reshape fixing their product): all static
    free: list[set[int]] = [set() for _ in example_inputs]
    for position, axis in (place for group in found for place in group):
        free[position].add(axis)
    return free


def min_sizes(exported_program) -> dict[str, int]:
    """The smallest size of each free symbolic input axis (at least 2: torch.export specialises
    size 1), by name: a branch on ``s0 > 4`` or a kernel-3 convolution raise it."""
    ranges, pinned = exported_program.range_constraints, pinned_sizes(exported_program)
    return {str(expr): max(2, int(ranges[expr].lower)) for expr in _user_input_sizes(exported_program)
            if not expr.is_number and str(expr) not in pinned and expr in ranges}


def pin(proto, exported_program) -> None:
    """Write the :func:`pinned_sizes` into ``proto``'s input shapes as the static sizes they are,
    so the runtime sees (and checks) them as it would after a static export, and the
    :func:`min_sizes` of the others into its metadata (:data:`MIN_SIZES`)."""
    pinned = pinned_sizes(exported_program)
    for graph_input in proto.graph.input:
        for dim in graph_input.type.tensor_type.shape.dim:
            if dim.dim_param in pinned:
                dim.dim_value = pinned[dim.dim_param]
    entry = proto.metadata_props.add()
    entry.key, entry.value = MIN_SIZES, json.dumps(min_sizes(exported_program))


#: ONNX's element types of the input dtypes a partition takes (``onnx.TensorProto``'s numbers)
_ONNX_TYPES = {torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.int32: 6, torch.int64: 7, torch.bool: 9,
               torch.float16: 10, torch.float64: 11, torch.bfloat16: 16}


@dataclass(frozen=True)
class InputShapes:
    """The input names, element types and shapes of a serialized ONNX model (an int: that size; a
    name: a symbolic size, the same wherever the name recurs) and the smallest size of each name
    (:data:`MIN_SIZES`; 2 where the model does not say)."""

    names: tuple[str, ...]
    types: tuple[int, ...]
    shapes: tuple[tuple[int | str, ...], ...]
    minimums: dict[str, int]

    @classmethod
    def of(cls, source: bytes | os.PathLike) -> InputShapes:
        """The inputs of a partition's ONNX model, serialized or a file (its external data, the
        weights, is not read)."""
        import onnx

        if isinstance(source, (bytes, bytearray)):
            model = onnx.load_from_string(bytes(source))
        else:
            model = onnx.load(os.fspath(source), load_external_data=False)
        inputs = [(i.name, i.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim])
                  for i in model.graph.input]
        return cls.described(inputs, {entry.key: entry.value for entry in model.metadata_props})

    @classmethod
    def described(cls, inputs: Sequence[tuple[str, int, Sequence[int | str | None]]],
                  metadata: Mapping[str, str]) -> InputShapes:
        """From what a runtime already read of the model: (name, ONNX element type, sizes) per
        input, a size None or 0 where unknown, and the model's metadata; so a runtime that parsed
        the model does not have the core parse it (weights and all) once more."""
        return cls(tuple(name for name, _, _ in inputs), tuple(kind for _, kind, _ in inputs),
                   tuple(tuple(size or 0 for size in sizes) for _, _, sizes in inputs),
                   json.loads(metadata.get(MIN_SIZES, "{}")))

    def fit(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether ``inputs`` fit: their element types the model's, each fixed size equal, each
        name one size wherever it recurs and at least its minimum."""
        if len(inputs) != len(self.shapes):
            return False
        seen: dict[str, int] = {}
        for tensor, kind, shape in zip(inputs, self.types, self.shapes):
            given = tensor.shape
            if len(given) != len(shape) or _ONNX_TYPES.get(tensor.dtype) != kind:
                return False
            for size, expected in zip(given, shape):
                if isinstance(expected, str) and expected:
                    if size < self.minimums.get(expected, 2) or seen.setdefault(expected, size) != size:
                        return False
                elif expected != size:  # a fixed size, or 0 (unknown to ONNX): never assumed
                    return False
        return True


def check(program, example_inputs: tuple, axes: dict[int, str]) -> None:
    """Raise :class:`ExportError` when an asked-for axis of an input of torch.onnx's ``program``
    stayed static (read from the unserialized model: no 2 GB message is built for it)."""
    tensors = [v for v in example_inputs if isinstance(v, torch.Tensor)]
    for value, graph_input in zip(tensors, program.model.graph.inputs):
        dims = list(graph_input.shape or ())
        static = {axis: name for axis, name in axes.items() if axis < len(dims) and isinstance(dims[axis], int)}
        if static:
            raise ExportError(f"input {graph_input.name!r}: the model's graph fixes its {described(static)} size "
                              f"(it stays {[dims[a] for a in static]}){_sequence_hint(static)}; export it without "
                              "that dynamic axis, or at the size you need")


#: what :func:`prepare` puts between an axis's name and its input's position
_OF_INPUT = "__input"


def untie(model, axes: dict[int, str]) -> None:
    """Name the symbolic sizes of ``model`` (the exporter's ``onnx_ir`` model) as asked: an axis
    takes its asked-for name where its size is the first input's of that name, else
    ``<name>_<input>`` (an EmbeddingBag's ids, the bag entries, beside the offsets, one per bag).
    One name for both made ONNX Runtime take them as one size (it reused one buffer for both and
    failed at run time), so :func:`prepare` asks torch for a name per input, tied where the graph
    ties the sizes."""
    import onnx_ir as ir

    inputs = {f"{_OF_INPUT}{position}": value.name for position, value in enumerate(model.graph.inputs)}
    pattern = re.compile("(" + "|".join(re.escape(name) for name in axes.values()) + f")({_OF_INPUT}\\d+)")
    named: dict[str, str] = {}
    for value in model.graph.inputs:  # in input order: the first input of a size names it
        for dim in value.shape or ():
            for found in pattern.finditer(str(dim) if not isinstance(dim, int) else ""):
                taken = found.group(1) in named.values()
                named.setdefault(found.group(0), f"{found.group(1)}_{inputs[found.group(2)]}" if taken
                                 else found.group(1))
    for value in [*model.graph.inputs, *model.graph.outputs, *(v for node in model.graph for v in node.outputs)]:
        if value.shape is not None and any(not isinstance(dim, int) for dim in value.shape):
            value.shape = ir.Shape([pattern.sub(lambda m: named.get(m.group(0), m.group(0)), str(dim))
                                    if not isinstance(dim, int) else dim for dim in value.shape])


def specialised(exc: Exception) -> bool:
    """Whether torch.export refused a dynamic axis because the graph fixes it."""
    text = f"{exc} {exc.__cause__}"
    return "inferred a static shape" in text or "ConstraintViolation" in text or "specializ" in text


def torch_message(exc: Exception, limit: int) -> str:
    """The exporter's message on one line, its terminal colours dropped, from its summary on."""
    text = _ANSI.sub("", " ".join(str(exc).split()))
    _, found, summary = text.partition("## Exception summary ")
    return (summary if found else text)[:limit]


def _sequence_hint(axes: Mapping[int, str]) -> str:
    """Where ``dynamic_sequence`` chose the axis: which one it is, and how to name another."""
    if axes.get(1) != SEQUENCE:
        return ""
    return ("; dynamic_sequence makes axis 1 dynamic (the tokens of a token model): for a (batch, channels, time) "
            "input name the time axis instead, dynamic_axes={2: 'time'}")


def export_failure(exc: Exception, axes: dict[int, str]) -> ExportError:
    """The error for an export that torch refused because a dynamic axis cannot vary."""
    return ExportError(f"the model cannot be exported with a dynamic {described(axes)} size: its graph fixes "
                       f"{'one of them' if len(axes) > 1 else 'it'} ({torch_message(exc, 600)}){_sequence_hint(axes)}; "
                       "export it without that dynamic axis, or at the size you need")


__all__ = ["BATCH", "MIN_SIZES", "SEQUENCE", "check", "described", "dynamic_axes", "export_failure",
           "flexible_shapes", "free_axes", "free_symbols_only", "InputShapes", "min_sizes", "pin", "pinned_sizes",
           "prepare", "specialised", "torch_message", "untie"]
