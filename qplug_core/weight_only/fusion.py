"""Linears that read one input run as one kernel call: attention's q/k/v, a gated MLP's gate/up.

At decode (one token), a weight-only linear is a short kernel call (~0.1 ms at 1024 x 1024 int4)
whose fixed costs (the call, waking a kernel's thread pool) are a large share of it. Linears that
read the very same input tensor are found by running the model once (:func:`shared_inputs`) and
joined (:func:`fuse`): their quantized rows are stacked into one weight, packed once for the
fastest kernel of the stacked shape, and the first member called computes every member's output;
the others take theirs while their input is unchanged. On a 220 M Llama (``bench/bench_llm.py``,
two threads, Intel Xeon with VNNI) a 64-token ``generate()`` took 1.67 instead of 1.80 s at int4 g32
and 2.04 instead of 2.22 s at int8 g32.

The members keep their buffers (views into the stacked ones, so no weight is held twice), their
names and ``qp.save``'s format; the groups are saved by name and joined again at ``qp.load``.
Each output row is the same dot product as before, so fused and separate outputs are equal where
the kernel's sums do not depend on the output width (the tests check this per kernel).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from qplug_core.errors import ConfigValidationError, ModelStateError
from qplug_core.kernels.per_token import PerThread, version_counter
from qplug_core.kernels.weight_only import WeightOnlyKernel
from qplug_core.kernels.weight_only_scheme import QuantizedWeight
from qplug_core.weight_only.modules import DerivedPacking, WeightOnlyLinear, run_linear
from qplug_core.weight_only.selection import Choice


class FusedLinears:
    """The one kernel call of linears reading one input; member ``i`` gets columns ``i`` of it.

    A member's output is handed out once: a second call with the same input, a call with
    another input, or an input changed in place since (its version counter; inference tensors,
    which have none, are compared with a copy) runs the kernel again. The state is per thread.
    The stacked weight, its packed form and the stacked bias are derived from the members' own
    tensors and made again when one of those changes (``load_state_dict``, an in-place edit)."""

    def __init__(self, kernel: WeightOnlyKernel, names: tuple[str, ...], members: list[WeightOnlyLinear],
                 weight: QuantizedWeight, packed: Any) -> None:
        self.kernel, self.names, self.members, self.scheme = kernel, names, members, weight.scheme
        self.sizes = [m.out_features for m in members]
        self._state = PerThread()
        self._packing = DerivedPacking()
        _share_rows(members, weight)
        self._packing.put(self._sources(), (packed, _stacked_bias(members), members[0].input_scale))

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        state = self._state
        outputs = getattr(state, "outputs", None)
        if outputs is None or outputs[index] is None or not _unchanged(state, x):
            outputs = state.outputs = self._run(x)
            state.source, state.version = weakref.ref(x), version_counter(x)
            state.copy = x.clone() if state.version is None else None
        out, outputs[index] = outputs[index], None
        return out

    def _run(self, x: torch.Tensor) -> list[torch.Tensor]:
        packed, bias, input_scale = self._packing.get(self._sources, self._repack)
        y = run_linear(self.kernel, packed, x, bias, input_scale, sum(self.sizes), self.scheme)
        return [part.contiguous() for part in y.split(self.sizes, dim=-1)]

    def _sources(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(t for m in self.members for t in (*m.weight_tensors(), m.bias, m.input_scale))

    def _repack(self) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
        members = self.members
        scale = members[0].input_scale
        if not all(_same_tensor(m.input_scale, scale) for m in members):
            raise ModelStateError(f"the linears {', '.join(self.names)} run as one kernel call but now have "
                                  "different input_scale values, which one call cannot apply: give them equal "
                                  "input_scale, or rebuild the model with qp.load from a file qp.save wrote")
        weight = _stacked(members)
        _share_rows(members, weight)
        return self.kernel.pack(weight), _stacked_bias(members), scale


def _share_rows(members: list[WeightOnlyLinear], weight: QuantizedWeight) -> None:
    """Make the members' buffers views of their rows of the stacked ``weight`` (held once)."""
    start = 0
    for member in members:
        end = start + member.out_features
        member.qweight, member.scales = weight.data[start:end], weight.scales[start:end]
        if weight.zero_points is not None:
            member.zero_points = weight.zero_points[start:end]
        start = end


def _unchanged(state: Any, x: torch.Tensor) -> bool:
    if state.source() is not x:
        return False
    if state.version is not None:
        return version_counter(x) == state.version
    return torch.equal(state.copy, x)


def shared_inputs(run: Callable[[], Any], linears: dict[str, nn.Module]) -> list[tuple[str, ...]]:
    """Groups (in call order) of ``linears`` that read the very same tensor in ``run()``, one
    forward of their model; each linear's first call counts."""
    inputs: dict[str, torch.Tensor] = {}

    def keep_input(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], torch.Tensor):
                inputs.setdefault(name, args[0])  # kept alive: ids stay unique
        return hook

    handles = [m.register_forward_pre_hook(keep_input(n)) for n, m in linears.items()]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    readers: dict[int, list[str]] = {}
    for name, tensor in inputs.items():
        readers.setdefault(id(tensor), []).append(name)
    return [tuple(names) for names in readers.values() if len(names) > 1]


#: (layer names, their weight, activation dtype) -> (kernel, packed weight, measurement or None)
Pick = Callable[[tuple[str, ...], QuantizedWeight, torch.dtype], tuple[WeightOnlyKernel, Any, Choice | None]]


def fuse(model: nn.Module, groups: list[tuple[str, ...]], dtypes: dict[str, torch.dtype], pick: Pick
         ) -> tuple[list[tuple[tuple[str, ...], Choice | None]], dict[tuple[str, ...], str]]:
    """Join each group of ``model``'s :class:`WeightOnlyLinear` that can be (one scheme, one
    activation dtype in ``dtypes``, one input scale), its kernel from ``pick``; returns the groups
    joined, each with the measurement that chose its kernel (``None`` when known already, forced or
    recorded), and why each other group was not."""
    modules = dict(model.named_modules())
    joined = []
    refused: dict[tuple[str, ...], str] = {}
    for names in groups:
        members = [modules.get(name) for name in names]
        why = _why_not_joinable(names, members, [dtypes.get(name) for name in names])
        if why is not None:
            refused[tuple(names)] = why
            continue
        linears: list[WeightOnlyLinear] = members  # type: ignore[assignment]
        weight = _stacked(linears)
        try:
            kernel, packed, measured = pick(tuple(names), weight, dtypes[names[0]])
        except ConfigValidationError as exc:  # a forced kernel that takes the members but not their stack
            refused[tuple(names)] = f"kernel {exc.value!r} does not take their stacked weight"
            continue
        group = FusedLinears(kernel, tuple(names), linears, weight, packed)
        for index, member in enumerate(linears):
            member.join(group, index)
        joined.append((tuple(names), measured))
    return joined, refused


def _why_not_joinable(names: tuple[str, ...], members: list[nn.Module | None],
                      dtypes: list[torch.dtype | None]) -> str | None:
    """Why these linears cannot run as one kernel call, or ``None`` when they can."""
    if len(members) < 2:
        return "a group needs two linears"
    for name, member in zip(names, members, strict=True):
        if not isinstance(member, WeightOnlyLinear):
            return f"{name} is not a weight-only linear"
        if member.fused is not None:
            return f"{name} already runs in another group"
    if None in dtypes or len(set(dtypes)) != 1:
        return f"their activation dtypes differ ({', '.join(str(d) for d in dtypes)})"
    linears: list[WeightOnlyLinear] = members  # type: ignore[assignment]
    first = linears[0]
    if any(m.scheme != first.scheme for m in linears):
        return "their schemes differ"
    if any(m.in_features != first.in_features for m in linears):
        return "their input features differ"
    if not all(_same_tensor(m.input_scale, first.input_scale) for m in linears):
        return "their input scales (AWQ's 1 / s) differ, which one call cannot apply"
    return None


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is None and b is None or (a is not None and b is not None and torch.equal(a, b))


def _stacked(members: list[WeightOnlyLinear]) -> QuantizedWeight:
    weights = [m.quantized_weight() for m in members]
    zero_points = None if weights[0].zero_points is None else torch.cat([w.zero_points for w in weights])
    return QuantizedWeight(weights[0].scheme, (sum(w.shape[0] for w in weights), weights[0].shape[1]),
                           torch.cat([w.data for w in weights]), torch.cat([w.scales for w in weights]),
                           zero_points)


def _stacked_bias(members: list[WeightOnlyLinear]) -> torch.Tensor | None:
    if all(m.bias is None for m in members):
        return None
    dtype = next(m.bias.dtype for m in members if m.bias is not None)
    return torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, dtype=dtype)
                      for m in members])
