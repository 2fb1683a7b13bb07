"""Block-by-block calibration of a model built of repeated blocks (a decoder's layers), as GPTQ's
reference code, AutoGPTQ, AutoAWQ and llm-compressor do it.

Recording the inputs of every linear of the model in one pass holds them all at once (24x one
block's on a Qwen2-0.5B). Here the model runs once on the calibration batches to capture each
block's arguments (the hidden states of the first block; the attention mask, position
embeddings... every block takes) and the first block's linears' inputs, stopping before the head;
then, one block at a time, the block runs on its inputs to record its linears' inputs, its
linears are quantized, and the quantized block runs again to make the next block's inputs: later
blocks are calibrated on what the quantized model computes.

The blocks are the ``nn.ModuleList`` of same-class modules holding the most quantized linears
(``model.model.layers`` of a Hugging Face decoder, ``encoder.layer`` of BERT), and only if the
float run shows that they chain: each block runs once per batch, in order, reads the previous
block's output as its hidden states and no other part of it (T5's blocks pass a position bias
on). Otherwise the whole model is recorded in one pass, and :attr:`WeightOnlyInfo.calibration`
says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qplug_core.weight_only.awq import InputRecorder, no_calibration, record_inputs
from qplug_core.weight_only.batches import run_batch

#: quantizes the linears named in a dict of their recorded inputs (name -> rows ``[T, K]``)
Quantize = Callable[[dict[str, torch.Tensor]], None]


def calibrate(model: nn.Module, names: Sequence[str], calibration: Sequence[Any], max_rows: int,
              quantize: Quantize) -> str:
    """Record the inputs of the linears ``names`` of ``model`` on ``calibration`` and hand them to
    ``quantize``, a block at a time where the model's blocks chain, else all at once; returns how
    (for :attr:`WeightOnlyInfo.calibration`)."""
    if not calibration:
        raise no_calibration()
    with torch.no_grad(), _no_cache(model):
        found = repeated_blocks(model, names)
        why = "no nn.ModuleList of repeated blocks holds its linears"
        if found is not None:
            why = _by_blocks(model, *found, names, calibration, max_rows, quantize)
            if why is None:
                return f"block by block: {len(found[1])} blocks of {found[0]}"
            why = f"the blocks of {found[0]} do not chain ({why})"
        quantize(record_inputs(model, _modules(model, names), calibration, max_rows))
    return f"the whole model at once: {why}"


def _by_blocks(model: nn.Module, prefix: str, blocks: nn.ModuleList, names: Sequence[str],
               calibration: Sequence[Any], max_rows: int, quantize: Quantize) -> str | None:
    """Calibrate block by block; or, before quantizing anything, say why the blocks do not chain.

    The float run records block 0's linears, whose inputs it computes exactly, and stops as soon
    as the last block and every linear outside the blocks has been called (an LLM's head, most of
    a whole run, is not computed). Linears outside the blocks (an untied ``lm_head``) are
    calibrated on its inputs: the later blocks compute there only then, and otherwise pass their
    inputs on (:meth:`_BlockCalls.passed_on`), since only each block's arguments are wanted.
    (Calibrating an untied ``lm_head`` on the quantized blocks' outputs instead was measured no
    better: config-built Llama, 5 seeds, ``bench_weight_only_calibration.py accuracy``.)"""
    inside = [[n for n in names if n.startswith(f"{prefix}.{i}.")] for i in range(len(blocks))]
    outside = _modules(model, [n for n in names if not n.startswith(f"{prefix}.")])
    calls = _BlockCalls(blocks)
    passing = blocks[1:] if not outside and len({id(block) for block in blocks}) == len(blocks) else []
    with calls, InputRecorder({**_modules(model, inside[0]), **outside}) as recorder, \
            _answering(passing, calls.passed_on):
        for index, batch in enumerate(calibration):
            with _StopWhenCalled({**outside, f"{prefix}.{len(blocks) - 1}": blocks[-1]}):
                _run_until_stopped(model, batch, index)
            calls.next_batch()
            recorder.next_batch()
    if calls.broken is not None:
        return calls.broken
    quantize(recorder.kept(max_rows))
    hidden, calls.first = calls.first, []
    for i, block in enumerate(blocks):
        block_calls, calls.calls[i] = calls.calls[i], []
        if i and inside[i]:
            with InputRecorder(_modules(model, inside[i])) as recorder:
                for call, states in zip(block_calls, hidden, strict=True):
                    call.run(block, states)
                    recorder.next_batch()
            quantize(recorder.kept(max_rows))
        if i + 1 < len(blocks):  # the block as quantized makes the next one's inputs
            hidden = [call.run(block, states) for call, states in zip(block_calls, hidden, strict=True)]
    return None


@contextlib.contextmanager
def _answering(blocks: Sequence[nn.Module], answer: Callable[..., Any]) -> Iterator[None]:
    """Each of ``blocks`` returns ``answer(*args, **kwargs)`` instead of computing (its hooks still
    run); set on the instance, so the model still reads the block's own attributes (``attention_type``),
    and a ``forward`` the instance had (a wrapper) is put back after."""
    own = [block.__dict__.get("forward") for block in blocks]  # a wrapper set on the instance (accelerate's hooks)
    for block in blocks:
        block.forward = answer
    try:
        yield
    finally:
        for block, forward in zip(blocks, own):
            if forward is None:
                del block.forward
            else:
                block.forward = forward


class _Stop(BaseException):
    """Raised by a hook once a run has computed what calibration needs of it, and caught by
    :func:`_run_until_stopped`. Not an ``Exception``: a model's own ``except Exception`` (and
    :func:`run_batch`'s) must not take it for an error."""


def _run_until_stopped(model: nn.Module, batch: Any, index: int) -> None:
    try:
        run_batch(model, batch, index)
    except _Stop:
        pass


class _StopWhenCalled:
    """While entered (for one run), the run ends once each of ``modules`` has been called, before
    the last one computes (the hooks registered before, an :class:`InputRecorder`'s or
    :class:`_BlockCalls`', have seen its inputs)."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self._modules = modules
        self._waiting: set[str] = set(modules)
        self._handles: list[Any] = []

    def __enter__(self) -> None:
        self._handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in self._modules.items()]

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, name: str) -> Callable:
        def called(module: nn.Module, args: tuple) -> None:
            self._waiting.discard(name)
            if not self._waiting:
                raise _Stop
        return called


def repeated_blocks(model: nn.Module, names: Sequence[str]) -> tuple[str, nn.ModuleList] | None:
    """The ``nn.ModuleList`` of two or more modules of one class holding the most of the linears
    ``names`` (the outermost of nested lists), with its name; ``None`` if none holds any."""
    best, count = None, 0
    for prefix, module in model.named_modules():
        if not prefix or not isinstance(module, nn.ModuleList) or len(module) < 2 \
                or len({type(block) for block in module}) != 1:
            continue
        held = sum(name.startswith(prefix + ".") for name in names)
        if held > count:
            best, count = (prefix, module), held
    return best


@dataclass
class _Call:
    """One call of a block: its arguments with the hidden states (at ``slot``, a position or a
    keyword) taken out."""

    args: tuple
    kwargs: dict[str, Any]
    slot: int | str

    def run(self, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The block's hidden-state output for ``hidden``."""
        args, kwargs = list(self.args), dict(self.kwargs)
        if isinstance(self.slot, int):
            args[self.slot] = hidden
        else:
            kwargs[self.slot] = hidden
        return _hidden_output(block(*args, **kwargs))


def _hidden_output(output: Any) -> Any:
    """A block's hidden states: its output, or the first element of a tuple (older transformers)."""
    return output[0] if isinstance(output, (tuple, list)) and output else output


def _without_hidden(output: Any) -> tuple | None:
    """A block's output with its hidden states left out (``None``: the output is the hidden states)."""
    return (None, *output[1:]) if isinstance(output, (tuple, list)) and output else None


def _with_hidden(rest: tuple | None, hidden: torch.Tensor) -> Any:
    """The block output :func:`_without_hidden` kept, with ``hidden`` as its hidden states."""
    return hidden if rest is None else (hidden, *rest[1:])


class _BlockCalls:
    """While entered, keeps every block's calls (:class:`_Call`) of each batch and the first block's
    hidden states; :attr:`broken` says why the blocks do not chain, once seen."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        self._blocks = blocks
        self.calls: list[list[_Call]] = [[] for _ in blocks]
        self.first: list[torch.Tensor] = []
        self.broken: str | None = None
        self._next = 0
        self._last: Any = None  # the previous block's output in this batch
        self._rest: tuple | None = None  # block 0's output in this batch without its hidden states
        self._slot: int | str = 0  # where the block called last took its hidden states
        self._handles: list[Any] = []

    def __enter__(self) -> _BlockCalls:
        for i, block in enumerate(self._blocks):
            self._handles.append(block.register_forward_pre_hook(self._before(i), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._after))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._last = [], None

    def _before(self, i: int) -> Callable:
        def hook(block: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.broken is None:
                self._take(i, args, kwargs)
            if self.broken is not None:
                self._forget()
        return hook

    def _forget(self) -> None:
        self.calls, self.first = [[] for _ in self._blocks], []

    def _take(self, i: int, args: tuple, kwargs: dict) -> None:
        if args and isinstance(args[0], torch.Tensor):
            slot: int | str = 0
            hidden = args[0]
        elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
            slot, hidden = "hidden_states", kwargs["hidden_states"]
        else:
            self.broken = f"block {i} takes no hidden-state tensor first"
            return
        if i != self._next:
            self.broken = f"block {i} ran where block {self._next} was next"
            return
        others = [a for j, a in enumerate(args) if j != slot] + [v for k, v in kwargs.items() if k != slot]
        if i and (hidden is not _hidden_output(self._last)
                  or any(any(value is t for t in _tensors(self._last)) for value in others)):
            self._last = None
            self.broken = f"block {i} does not read exactly block {i - 1}'s hidden states"
            return
        self._slot = slot
        kept_args = tuple(None if j == slot else a for j, a in enumerate(args))
        kept_kwargs = {k: (None if k == slot else v) for k, v in kwargs.items()}
        self.calls[i].append(_Call(kept_args, kept_kwargs, slot))
        if i == 0:
            self.first.append(hidden)
        self._next = i + 1

    def _after(self, block: nn.Module, args: tuple, output: Any) -> None:
        self._last = output
        if block is self._blocks[0]:
            self._rest = _without_hidden(output)

    def passed_on(self, *args: Any, **kwargs: Any) -> Any:
        """What a later block answers in the float run instead of computing (:func:`_answering`):
        its hidden states as they came in, in block 0's output. Only the arguments of each block
        are wanted of that run, and where the blocks chain they do not depend on its outputs."""
        if self.broken is not None:  # the whole model will be recorded: nothing more is wanted
            raise _Stop
        return _with_hidden(self._rest, args[0] if self._slot == 0 else kwargs["hidden_states"])

    def next_batch(self) -> None:
        """A batch ended: every block must have run on it."""
        if self.broken is None and self._next not in (0, len(self._blocks)):
            self.broken = f"only blocks 0-{self._next - 1} of {len(self._blocks)} ran"
            self._forget()
        if self.broken is None and self._next == 0:
            self.broken = "the blocks did not run"
        self._next, self._last = 0, None


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    return [t for t in output if isinstance(t, torch.Tensor)] if isinstance(output, (tuple, list)) else []


def _modules(model: nn.Module, names: Sequence[str]) -> dict[str, nn.Module]:
    return {name: model.get_submodule(name) for name in names}


@contextlib.contextmanager
def _no_cache(model: nn.Module) -> Iterator[None]:
    """A Hugging Face model's ``config.use_cache`` off: calibration builds no KV cache, and a block
    run again is not given one."""
    config = getattr(model, "config", None)
    used = getattr(config, "use_cache", None)
    if used is None:
        yield
        return
    config.use_cache = False  # type: ignore[union-attr]
    try:
        yield
    finally:
        config.use_cache = used  # type: ignore[union-attr]
