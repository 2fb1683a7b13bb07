"""A decoder's one-token decode steps on one thread where that measured faster than torch's count.

Between the small GEMMs of a one-token step, a decoder runs dozens of smaller ops (norms, rotary,
attention, softmax, residual adds). At 2 threads on a shared CPU, each is a fork/join whose other
thread may be asleep, waiting for the scheduler: choosing the thread count per kernel call
(:func:`~qplug_core.kernels.decode_threads.run_with_fastest_threads`) leaves all of those at 2
threads. So the models ``qp.quantize_weights`` and ``qp.quantize_w8a8`` return (and ``qp.load``
fills) run their whole decode step on the thread count measured faster for it
(:class:`~qplug_core.kernels.decode_threads.ThreadChoice`, per thread count and batch size).
Prompts (prefill) are not touched: there many threads win. A step on one thread keeps torch's
count as its :func:`~qplug_core.kernels.decode_threads.thread_budget`: weight-only kernels with
thread pools of their own take it where that measured faster
(:class:`~qplug_core.weight_only.modules.WeightOnlyLinear`).

It is installed as the model's ``forward`` (an instance attribute wrapping the class's own, so
``generate()``, the KV cache and ``inspect.signature(model.forward)`` stay as they were, as
accelerate's hooks do), and kept as ``model.qplug_decode_threads``: its ``choices`` say what was
measured, and ``model.qplug_decode_threads.enabled = False`` turns it off. ``qp.save`` records the
choices made (:meth:`DecodeStepThreads.recorded`), first making the batch-1 one on a few decode
steps of its own when the model has made none at torch's thread count
(:func:`measure_before_saving`: a model saved straight after quantizing recorded nothing, and every
load timed its first steps), and ``qp.load`` starts from them
(:meth:`DecodeStepThreads.restore`) instead of timing the first steps again, except those made at
more threads than this machine has cores, which are measured here. Only thread counts
change, so outputs do not (the kernels and torch's ops split work over threads without changing
any sum's order at these shapes; the tests check bit-identical logits and tokens).
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from qplug_core.errors import warn_user
from qplug_core.flows.tags import DECODE_THREADS
from qplug_core.kernels.decode_threads import RUNS, ThreadChoice, thread_budget

#: the model attribute holding its :class:`DecodeStepThreads`
ATTRIBUTE = DECODE_THREADS
#: decode steps of one (thread count, batch) between two measurements
REMEASURE_EVERY = 128
#: the KV-cache argument of a decoder's forward: transformers >= 5.x, then older releases
CACHE_ARGUMENTS = ("cache", "past_key_values")


class DecodeStepThreads:
    """A model's ``forward`` that runs one-token decode steps on the thread count measured
    faster; every other call goes straight to the wrapped forward."""

    def __init__(self, forward: Callable[..., Any], remeasure_every: int = REMEASURE_EVERY,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        #: the model's own forward (``inspect.signature`` follows it)
        self.__wrapped__ = forward
        self.remeasure_every, self.clock = remeasure_every, clock
        #: ``False``: every step on torch's thread count
        self.enabled = True
        #: (thread count, batch size) -> what was measured and chosen for those decode steps
        self.choices: dict[tuple[int, int], ThreadChoice] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        threads = torch.get_num_threads()
        batch = decode_batch(args, kwargs) if self.enabled and threads > 1 else None
        if batch is None:
            return self.__wrapped__(*args, **kwargs)
        choice = self.choices.get((threads, batch))
        if choice is None:
            choice = self.choices.setdefault((threads, batch),
                                             ThreadChoice(threads, self.remeasure_every, self.clock))
        with thread_budget(threads):
            return choice.run(lambda: self.__wrapped__(*args, **kwargs))

    def summary(self) -> dict[tuple[int, int], str]:
        """(thread count, batch) -> the choice and the totals it was made on, for reports."""
        lines = {}
        for key, choice in self.choices.items():
            chosen = "not measured yet" if choice.single is None else \
                f"{1 if choice.single else choice.threads} thread(s)"
            totals = ", ".join(f"{count} thread(s) {seconds * 1e3:.1f} ms" for count, seconds in choice.totals.items())
            if not totals and choice.single is not None:
                totals = "as recorded in the file"
            lines[key] = f"{chosen} ({totals})" if totals else chosen
        return lines

    def recorded(self) -> list[tuple[int, int, bool]]:
        """(thread count, batch, one thread?) of every choice made, for ``qp.save``."""
        return [(threads, batch, choice.single) for (threads, batch), choice in sorted(self.choices.items())
                if choice.single is not None]

    def restore(self, recorded: list[tuple[int, int, bool]]) -> None:
        """Start from ``recorded`` choices (a file's): each is used until its next measurement, but
        one made at more threads than this machine has cores is left to be measured here."""
        cores = usable_cores()
        for threads, batch, single in recorded:
            if threads <= cores:
                self.choices[threads, batch] = ThreadChoice(threads, self.remeasure_every, self.clock,
                                                            single=single)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def decode_batch(args: tuple, kwargs: dict[str, Any]) -> int | None:
    """The batch size of a call that is a one-token decode step (one new token per sequence,
    after a non-empty KV cache), ``None`` for any other call."""
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    cache = next((kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2 or tokens.shape[1] != 1 or cache is None:
        return None
    length = getattr(cache, "get_seq_length", None)
    if not (length() if callable(length) else len(cache)):
        return None  # a one-token prompt: nothing cached yet
    return int(tokens.shape[0])


def install(model: nn.Module) -> None:
    """Give ``model`` a :class:`DecodeStepThreads` forward if its forward takes a KV cache
    (:data:`CACHE_ARGUMENTS`) and it has none yet."""
    if isinstance(model.__dict__.get("forward"), DecodeStepThreads):
        return
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if not any(name in parameters for name in CACHE_ARGUMENTS):
        return
    step = DecodeStepThreads(model.forward)
    model.forward = step  # type: ignore[method-assign]
    setattr(model, ATTRIBUTE, step)


def measure_before_saving(model: nn.Module) -> None:
    """Make the batch-1 choice of a model that has made none at torch's thread count (one this
    machine's loads keep: no more threads than its cores), on one-token decode steps of its own:
    token 0 after a one-token prompt, as many steps as one measurement takes. A model whose forward
    does not take them is left to measure its first steps, and the user is told."""
    step = getattr(model, ATTRIBUTE, None)
    threads = torch.get_num_threads()
    if (not isinstance(step, DecodeStepThreads) or not step.enabled or not 1 < threads <= usable_cores()
            or any(count == threads for count, _ in step.choices)):
        return
    weight = next(model.parameters(), None)
    token = torch.zeros((1, 1), dtype=torch.long, device=None if weight is None else weight.device)
    try:
        cache_argument = next(name for name in CACHE_ARGUMENTS if name in inspect.signature(step).parameters)
        with torch.no_grad():
            output = model(token, use_cache=True)
            for _ in range(2 * (RUNS + 1)):
                cache = next(getattr(output, name) for name in CACHE_ARGUMENTS if getattr(output, name, None) is not None)
                output = model(token, use_cache=True, **{cache_argument: cache})
    except Exception as exc:  # a forward of the user's own: saving goes on without the choice
        warn_user(f"qplug: qp.save could not run a one-token decode step of {type(model).__name__} to choose its "
                  f"decode thread count ({type(exc).__name__}: {exc}); the file records no choice, so each load "
                  "times its first decode steps")
