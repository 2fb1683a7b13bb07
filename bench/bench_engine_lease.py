"""What the engine lease costs a pinned model's call, and whether threads on one engine still overlap.

Run: ``python bench/bench_engine_lease.py [--model digits_cnn] [--batch 1] [--rounds 2000] [--inner 20]
[--thread-rounds 15] [--calls 400]`` (``--rounds 0`` or ``--thread-rounds 0`` skips that part: pin
the per-call part to one core, give the threads two)

One fbgemm model (``qp.quantize``, random init) is called in three variants that differ only in the
engine hooks on its root: ``lease`` (``pin_engine`` as shipped), ``stack`` (the hooks before the
lease: a thread-local stack of engines, each call setting and restoring the global one, wrong with
two engines in two threads) and ``none`` (no engine hooks, the floor). Per-call cost: the variants
called round-robin in a rotating order, ``inner`` calls per sample, in this process's CPU time, as
median us per call. Throughput: ``calls`` calls in one thread, then split over two threads, for
each variant in a rotating order, ``thread-rounds`` times; the table gives median calls/s and the
2-thread / 1-thread ratio (near 1: the threads serialise; near 2 on two idle cores: they do not).
"""

from __future__ import annotations

import argparse
import copy
import threading
import time
from typing import Any, Callable

import torch
from _harness import interleaved, machine_line, median, quiet, table
from torch import nn

import qplug_core as qp
from qplug_core.kernels.base import _EnterEngine, _leave_engine
from qplug_core.zoo import example_inputs, get_model

_STACK = threading.local()


class _StackEnter:
    """The pre-hook before the lease: push the caller's engine, set the model's."""

    def __init__(self, engine: str) -> None:
        self.engine = engine

    def __call__(self, module: nn.Module, args: Any) -> None:
        previous = torch.backends.quantized.engine
        _STACK.__dict__.setdefault("stack", []).append(previous)
        if previous != self.engine:
            torch.backends.quantized.engine = self.engine


def _stack_leave(module: nn.Module, args: Any, output: Any) -> None:
    previous = _STACK.stack.pop()
    if torch.backends.quantized.engine != previous:
        torch.backends.quantized.engine = previous


def with_engine_hooks(model: nn.Module, variant: str) -> nn.Module:
    """A copy of ``model`` whose engine hooks are ``variant``'s (same places, other hooks kept)."""
    clone = copy.deepcopy(model)
    for key, hook in list(clone._forward_pre_hooks.items()):
        if isinstance(hook, _EnterEngine):
            if variant == "none":
                del clone._forward_pre_hooks[key]
            elif variant == "stack":
                clone._forward_pre_hooks[key] = _StackEnter(hook.engine)
    for key, hook in list(clone._forward_hooks.items()):
        if hook is _leave_engine:
            if variant == "none":
                del clone._forward_hooks[key]
                clone._forward_hooks_always_called.pop(key, None)
            elif variant == "stack":
                clone._forward_hooks[key] = _stack_leave
    return clone


class Overlap:
    """Counts calls that found another thread between the model's first and last layer (inside the
    engine hooks): none if the threads were serialised, whatever the machine's load."""

    def __init__(self, model: nn.Module) -> None:
        layers = list(model.children())
        self.lock, self.inside, self.calls, self.overlapped = threading.Lock(), 0, 0, 0
        self.handles = [layers[0].register_forward_pre_hook(self.enter),
                        layers[-1].register_forward_hook(self.leave)]

    def enter(self, *_: Any) -> None:
        with self.lock:
            self.calls += 1
            self.overlapped += self.inside > 0
            self.inside += 1

    def leave(self, *_: Any) -> None:
        with self.lock:
            self.inside -= 1

    def remove(self) -> str:
        for handle in self.handles:
            handle.remove()
        return f"{self.overlapped / self.calls:.0%}"


def runner(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model(x)
    return run


def calls_per_second(run: Callable[[], Any], calls: int, threads: int) -> float:
    """Wall-clock throughput of ``calls`` calls split over ``threads`` threads started together."""
    start_line = threading.Barrier(threads + 1)

    def work() -> None:
        start_line.wait()
        for _ in range(calls // threads):
            run()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    start_line.wait()
    start = time.perf_counter()
    for worker in workers:
        worker.join()
    return calls / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="digits_cnn")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--thread-rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    model = get_model(args.model, seed=0).eval()
    calibration = [example_inputs(args.model, 8, seed=seed) for seed in range(4)]
    with quiet():
        int8 = qp.quantize(model, calibration[0], calibration, backend="fbgemm", progress=False)
    x = example_inputs(args.model, args.batch, seed=100)
    models = {variant: with_engine_hooks(int8, variant) for variant in ("lease", "stack", "none")}
    runs = {variant: runner(m, *x) for variant, m in models.items()}
    assert torch.equal(runs["lease"](), runs["stack"]())  # "none" runs under the global engine

    if args.rounds:
        per_call(runs, args)
    if args.thread_rounds:
        throughput(runs, args)
        overlaps = {}
        for variant, model in models.items():
            overlap = Overlap(model)
            calls_per_second(runs[variant], args.calls, 2)
            overlaps[variant] = overlap.remove()
        print(f"calls in 2 threads that overlapped the other thread's inside the model: {overlaps}")
    print(f"\nload avg at end: {machine_line().rpartition('load avg ')[2]}")


def per_call(runs: dict[str, Callable[[], Any]], args: argparse.Namespace) -> None:
    samples = interleaved(runs, args.rounds, warmup=20, inner=args.inner, clock=time.process_time)
    floor = median(samples["none"]) * 1e6
    rows = [[v, f"{median(samples[v]) * 1e6:.2f}", f"{median(samples[v]) * 1e6 - floor:+.2f}"] for v in runs]
    print(f"\n{args.model} batch {args.batch}, fbgemm: {args.rounds} interleaved rounds of {args.inner} "
          "calls, CPU time, median us per call")
    print(table(["hooks", "us/call", "vs none"], rows))


def throughput(runs: dict[str, Callable[[], Any]], args: argparse.Namespace) -> None:
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(args.thread_rounds):
        names = list(runs)
        for variant in names[r % len(names):] + names[:r % len(names)]:
            for threads in (1, 2):
                rates.setdefault((variant, threads), []).append(
                    calls_per_second(runs[variant], args.calls, threads))
    rows = [[v, f"{median(rates[v, 1]):.0f}", f"{median(rates[v, 2]):.0f}",
             f"{median(rates[v, 2]) / median(rates[v, 1]):.2f}"] for v in runs]
    print(f"\n{args.model} batch {args.batch}, fbgemm, in 1 and 2 threads: {args.calls} calls, "
          f"{args.thread_rounds} rotating rounds, median wall-clock calls/s")
    print(table(["hooks", "1 thread", "2 threads", "2/1"], rows))


if __name__ == "__main__":
    main()
