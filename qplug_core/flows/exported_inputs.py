"""The inputs torch.export specialised, checked at every call of the model it captured.

An export-captured graph holds the example's sizes wherever the model's Python read a size
(``if x.shape[0] > 1``, a ``view`` to ``[30, B * heads, 16]``), the example's value of every
``forward()`` argument that is a Python number or None (``unet(x, int(t), ctx)``: export takes an
int, float, bool or None as a constant, not as an input) and the relations between dynamic sizes it traced
(``t.size(0) == x.size(0)``: one size symbol for both). torch.export guards them with a forward
pre-hook and a ``_guards_fn`` call. Neither survives qplug's rewriting (the raised graph drops the
guard call, convert builds a new module without the hook, ``qp.save`` stores the graph only): a
call with another sequence length failed in a ``view``, a loaded model called with batch 3 after a
batch-1 example silently ran the batch-1 branch, a UNet quantized with ``t=999`` answered for 999
at every ``t`` (its calibration too), a model captured with ``mask=None`` ignored every mask it
was given, and a timestep of another rank failed in an ``expand`` printing generated code. What capture recorded on the placeholders (:data:`INPUT_SPEC`: the
example's shape, the dimensions export fixed and the symbols of the dynamic ones;
:data:`BAKED_INPUT`) is turned into one forward pre-hook on the observed and the converted model
(also after ``qp.load``) that raises :class:`InputMismatchError` before anything runs. Its checks
are precomputed: a call costs a few comparisons per input. A symbolically traced graph records
none of this (its inputs stay inputs, its sizes stay sizes) and gets no hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from qplug_core.errors import InputMismatchError
from qplug_core.flows.tags import BAKED_INPUT, EXPORT_RANGES, INPUT_SPEC
from qplug_core.ir.call_inputs import MISSING, InputPath, input_paths
from qplug_core.ir.hooks import drop_pre_hooks, keep_in_copies

if TYPE_CHECKING:
    from qplug_core.flows.input_relations import SizeRelations

__all__ = ["guard_exported_inputs"]


def guard_exported_inputs(gm: fx.GraphModule) -> None:
    """Check every call's inputs against what their torch.export capture assumed of them.

    The hook an observed model carried into its converted copy is replaced: it must run after the
    engine's (:func:`qplug_core.kernels.base.pin_engine`), whose forward hook leaves the engine as
    the call found it only if its pre-hook ran."""
    drop_pre_hooks(gm, lambda hook: isinstance(hook, _InputCheck))
    check = _InputCheck.of(gm)
    if check.tensors or check.constants:
        gm.register_forward_pre_hook(check, with_kwargs=True)
        keep_in_copies(gm)


@dataclass(frozen=True, eq=False)
class _Input:
    path: InputPath

    @property
    def name(self) -> str:
        return self.path.label


@dataclass(frozen=True, eq=False)
class _Tensor(_Input):
    """A tensor input of an exported capture: the example's shape and the dims fixed to it."""

    shape: tuple[int, ...]
    fixed: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class _Constant(_Input):
    """A Python number export built into the graph: the example's value."""

    value: Any


class _InputCheck:
    """Forward pre-hook: the tensor inputs of an exported capture have the example's rank and
    fixed sizes, the dims that share one export symbol (``shared``: groups of ``(tensor, dim)``)
    are equal, their sizes keep the other ``relations`` export guarded (not after ``qp.load``),
    and the Python numbers export built in are given the example's value."""

    def __init__(self, tensors: list[_Tensor], constants: list[_Constant],
                 shared: list[list[tuple[_Tensor, int]]], relations: SizeRelations | None) -> None:
        self.tensors, self.constants, self.shared = tensors, constants, shared
        self.relations = relations

    @classmethod
    def of(cls, gm: fx.GraphModule) -> _InputCheck:
        tensors, constants, nodes = [], [], []
        symbols: dict[str, list[tuple[_Tensor, int]]] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for path, node in zip(input_paths(gm), placeholders):
            spec = node.meta.get(INPUT_SPEC, {})
            if path is None:
                continue
            if BAKED_INPUT in node.meta:
                constants.append(_Constant(path, node.meta[BAKED_INPUT]))
            elif "fixed" in spec:  # only export decides which sizes are fixed
                tensor = _Tensor(path, tuple(spec["shape"]), tuple(spec["fixed"]))
                tensors.append(tensor)
                nodes.append(node)
                for dim, symbol in enumerate(spec.get("symbols", ())):
                    if symbol is not None:
                        symbols.setdefault(symbol, []).append((tensor, dim))
        relations = None
        if EXPORT_RANGES in gm.meta:  # a program the user exported; its check reads sympy (0.3 s to import)
            from qplug_core.flows.input_relations import SizeRelations

            relations = SizeRelations.of(gm, nodes, [tensor.name for tensor in tensors])
        return cls(tensors, constants, [dims for dims in symbols.values() if len(dims) > 1], relations)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        given: dict[_Tensor, torch.Tensor] = {}
        for tensor in self.tensors:
            value = tensor.path.value(args, kwargs)
            if value is not MISSING:
                given[tensor] = _checked_tensor(tensor, value)
        for dims in self.shared:
            sizes = [(tensor, dim, given[tensor].shape[dim]) for tensor, dim in dims if tensor in given]
            if len({size for _, _, size in sizes}) > 1:
                raise InputMismatchError(_unequal(sizes))
        if self.relations is not None and len(given) == len(self.tensors):
            self.relations.check([given[tensor].shape for tensor in self.tensors])
        for constant in self.constants:
            value = constant.path.value(args, kwargs)
            if value is not MISSING and (isinstance(value, torch.Tensor) or value != constant.value):
                raise InputMismatchError(_not_the_constant(constant, value))


def _checked_tensor(tensor: _Tensor, value: Any) -> torch.Tensor:
    """``value`` if it has the example's rank and fixed sizes, else the error saying which."""
    shape = tensor.shape
    if not isinstance(value, torch.Tensor):
        raise InputMismatchError(
            f"input {tensor.name!r} is {_described(value)}; the model was captured (torch.export) with a "
            f"tensor there (its example was shaped {shape}). Pass a tensor shaped like the example")
    got = value.shape
    if len(got) != len(shape):
        raise InputMismatchError(
            f"input {tensor.name!r} has {len(got)} dimension(s) {tuple(got)}; the model was captured "
            f"(torch.export) for {len(shape)} (its example was {shape}), and its graph takes no other rank. "
            f"Call it with inputs shaped like the example, or quantize with an example of the rank you "
            f"call it with")
    wrong = [d for d in tensor.fixed if got[d] != shape[d]]
    if wrong:
        sizes = ", ".join(f"size {got[d]} at dim {d} (captured with {shape[d]})" for d in wrong)
        raise InputMismatchError(
            f"input {tensor.name!r} has {sizes}: the model was captured (torch.export) with these sizes "
            f"fixed to its example's {shape}, so the graph takes no other. {_why_fixed(value, wrong)}")
    return value


def _why_fixed(value: torch.Tensor, wrong: list[int]) -> str:
    """Why export fixed those sizes and what to do: an image's height and width are qplug's choice
    (``ir/capture.py``), the others the model's code or a size of 1 in the example."""
    if value.is_floating_point() and value.dim() >= 4 and min(wrong) >= 2:
        return ("qplug's export capture keeps an image's height and width at the example's (dynamic ones made "
                "a vision transformer's capture 10-15x slower). To call it with other sizes, quantize with "
                "capture='symbolic' where the model traces, or export it yourself with the dynamic shapes you "
                "need and pass the ExportedProgram to qp.quantize (docs/guide/export.md)")
    return ("A size is fixed where the model's code reads it (a reshape or a branch on the size) and "
            "where the example's is 1. Call it with those sizes (pad or crop), or quantize with an example "
            "of the sizes you call it with, giving dynamic axes at least 2")


def _unequal(sizes: list[tuple[_Tensor, int, int]]) -> str:
    listed = ", ".join(f"input {tensor.name!r} dim {dim} is {size}" for tensor, dim, size in sizes)
    examples = ", ".join(f"{tensor.name!r} {tensor.shape}" for tensor in dict.fromkeys(t for t, _, _ in sizes))
    return (f"{listed}, but these sizes must be equal: torch.export captured the model with them equal "
            f"(one size for all of them, from the examples {examples}), and its graph computes with one "
            "of them for all. Call it with equal sizes there (expand or repeat an input of size 1 yourself), "
            "or quantize with examples whose sizes differ as your calls' do")


def _not_the_constant(constant: _Constant, value: Any) -> str:
    if constant.value is None:
        return (f"input {constant.name!r} is {_described(value)}, but it was None when the model was captured "
                f"(torch.export): export builds a None argument into the graph, so the model computes as if "
                f"{constant.name!r} were None whatever it is given. Quantize with an example (and calibration "
                f"batches) that pass {constant.name!r} set, as you call the model; or call it with None")
    kind = type(constant.value).__name__
    return (f"input {constant.name!r} is {_described(value)}, but the model was captured (torch.export) "
            f"with its example's value {constant.value!r} built in: a Python {kind} is no graph input, so "
            f"the model computes for {constant.value!r} whatever it is given. Quantize with {constant.name!r} "
            f"passed as a tensor (e.g. torch.tensor([{constant.name}])) in the example and the calibration "
            f"batches, and call it with tensors; or call it with {constant.value!r}")


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor shaped {tuple(value.shape)}"
    return f"{value!r} ({type(value).__name__})"
