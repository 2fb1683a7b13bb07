"""Where a decoder's linears read their inputs from, found by running the model once.

SmoothQuant divides a linear's input channels by ``s`` and multiplies the weight's columns by it.
That division is free only where it can be folded into the op producing the input, and only if
nothing else reads that op's output: a Llama RMSNorm feeds q/k/v alone (the residual bypasses
it), a BERT LayerNorm also feeds the residual stream, and folding there would change the model.
Module structure cannot tell the two apart; the data flow can. :func:`trace_inputs` runs the
model on a few tokens under a ``TorchFunctionMode`` that sees every torch function and tensor
method call with its arguments, and with forward hooks telling which module produced which
tensor, and reports two foldable shapes:

- :class:`NormGroup`: linears reading exactly the output of one norm module (LayerNorm,
  RMSNorm...) that nothing else reads (shape queries aside);
- :class:`MulPair`: a linear (``down_proj``) reading ``a * b`` where ``b`` is another linear's
  output (``up_proj``) read by nothing but that product, and the product read only by the
  first linear: scaling ``up_proj``'s output channels scales ``down_proj``'s inputs exactly.

A tensor the model returns is read by the user, whom no torch call shows: a seq2seq encoder's
output is read inside the model only by the decoder's cross-attention k/v projections, yet it is
also ``encoder_last_hidden_state`` and what ``get_encoder()`` gives; such a tensor counts as
read by something other than a linear, so no scale is folded into its producer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: calls that read a tensor's metadata, not its values: not consumers
_METADATA = frozenset({"__get__", "size", "dim", "numel", "stride", "is_contiguous", "element_size",
                       "data_ptr", "is_floating_point", "is_complex", "__len__", "ndimension",
                       "nelement", "get_device", "is_inference"})
_MULTIPLY = frozenset({"mul", "__mul__", "__rmul__"})
#: the reader recorded for a tensor the model returns
_RETURNED = "returned by the model"


@dataclass(frozen=True)
class NormGroup:
    """Linears (``linears``, by name) reading the output of norm module ``norm`` and nothing else."""

    norm: str
    linears: tuple[str, ...]


@dataclass(frozen=True)
class MulPair:
    """``consumer`` (a linear) reads ``x * producer(...)``; ``producer``'s output goes nowhere else."""

    producer: str
    consumer: str


def _name(func: Any) -> str:
    return getattr(func, "__name__", "")


class _Recorder(TorchFunctionMode):
    """Records, per tensor seen (by ``id``; tensors are kept alive so ids are not reused), the
    value-reading calls taking it and the call that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.readers: dict[int, list[str]] = defaultdict(list)
        self.made_by: dict[int, tuple[str, list[int]]] = {}
        self._alive: list[Any] = []

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        name = _name(func)
        if name in _METADATA:
            return result
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        for tensor in inputs:
            self.readers[id(tensor)].append(name)
        if isinstance(result, torch.Tensor):
            self.made_by[id(result)] = (name, [id(t) for t in inputs])
        self._alive.extend([*inputs, result])
        return result


def trace_inputs(model: nn.Module, run: Callable[[], Any], linears: dict[str, nn.Module],
                 norms: dict[str, nn.Module]) -> tuple[list[NormGroup], list[MulPair]]:
    """Run ``run()`` (one forward of ``model`` on a few tokens, returning the model's output) and
    find the foldable inputs of ``linears`` among the outputs of ``norms`` and of the other linears."""
    outputs: dict[int, str] = {}  # id(output) -> module that made it (the innermost)
    inputs: dict[str, int] = {}  # linear -> id(its input)

    recorder = _Recorder()

    def keep_output(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if isinstance(output, torch.Tensor) and id(output) not in outputs:
                outputs[id(output)] = name
                # reads so far were the module's own: ``x.type_as(x)`` or ``x.to(same dtype)``
                # at the end of a norm returns the tensor it read
                recorder.readers.pop(id(output), None)
        return hook

    def keep_input(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], torch.Tensor):
                inputs.setdefault(name, id(args[0]))
        return hook

    handles = [m.register_forward_hook(keep_output(n)) for n, m in {**norms, **linears}.items()]
    handles += [m.register_forward_pre_hook(keep_input(n)) for n, m in linears.items()]
    try:
        with torch.no_grad(), recorder:
            returned = run()
    finally:
        for handle in handles:
            handle.remove()
    for tensor in _tensors_in(returned):
        recorder.readers[id(tensor)].append(_RETURNED)
    by_input: dict[int, list[str]] = defaultdict(list)
    for name, tensor in inputs.items():
        by_input[tensor].append(name)
    groups, pairs = [], []
    for tensor, readers in by_input.items():
        # every value-reading call on the input is one of these linears' F.linear
        if recorder.readers[tensor] != ["linear"] * len(readers):
            continue
        producer = outputs.get(tensor)
        if producer in norms:
            groups.append(NormGroup(producer, tuple(readers)))
        elif len(readers) == 1:
            pair = _mul_pair(recorder, outputs, tensor, linears, readers[0])
            if pair is not None:
                pairs.append(pair)
    return groups, pairs


def _mul_pair(recorder: _Recorder, outputs: dict[int, str], tensor: int, linears: dict[str, nn.Module],
              consumer: str) -> MulPair | None:
    made = recorder.made_by.get(tensor)
    if made is None or made[0] not in _MULTIPLY or len(made[1]) != 2:
        return None
    for factor in made[1]:
        producer = outputs.get(factor)
        if producer in linears and producer != consumer and recorder.readers[factor] == [made[0]] \
                and made[1].count(factor) == 1:
            return MulPair(producer, consumer)
    return None


def _tensors_in(output: Any) -> list[torch.Tensor]:
    """The tensors in a model's output: a tensor, or tensors nested in tuples, lists and dicts (a
    Hugging Face ``ModelOutput`` is a dict)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [tensor for value in output.values() for tensor in _tensors_in(value)]
    if isinstance(output, (tuple, list)):
        return [tensor for value in output for tensor in _tensors_in(value)]
    return []
