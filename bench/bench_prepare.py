"""prepare_fx time vs graph size, qplug vs torch.ao (issue 6).

Run: ``python bench/bench_prepare.py [--blocks 50 200 800] [--reps 3] [--profile 800] [--no-ao]``

The model is a synthetic chain of ResNet-style blocks with 8 channels on an 8x8 input:
``relu(bn(conv(x)))`` -> ``bn(conv(.))`` -> ``relu(. + x)``, i.e. 7 graph nodes per block
(50 / 200 / 800 blocks ~ 350 / 1,400 / 5,600 nodes). qplug runs ``qp.prepare_fx`` with backend
"fbgemm" and its default static mapping; torch.ao runs its own ``prepare_fx`` with
``get_default_qconfig_mapping("fbgemm")`` (engine fbgemm) on the same float model. Each
repetition times both back to back in alternating order; the table shows medians, and the growth
columns the time ratio to the previous size (x4 blocks: 4.0 is linear); "qplug CPU s" is the
process CPU time of the same calls (the figure to read on a shared, loaded machine). ``--profile N`` adds a
cProfile of qplug's prepare at N blocks (top functions by cumulative and by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time

import torch
from _harness import gc_paused_times, machine_line, median, quiet, table, torch_ao
from torch import nn

import qplug_core as qp

CHANNELS, SPATIAL = 8, 8


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + x)


class Chain(nn.Module):
    def __init__(self, blocks: int, channels: int = CHANNELS) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(channels) for _ in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def make_model(blocks: int) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return Chain(blocks).eval(), (torch.randn(1, CHANNELS, SPATIAL, SPATIAL),)


def qplug_prepare(model: nn.Module, inputs: tuple) -> torch.fx.GraphModule:
    with quiet():
        return qp.prepare_fx(model, None, inputs, backend="fbgemm")


def ao_prepare(tq, model: nn.Module, inputs: tuple) -> torch.fx.GraphModule:
    with quiet():
        torch.backends.quantized.engine = "fbgemm"
        mapping = tq.get_default_qconfig_mapping("fbgemm")
        return tq.quantize_fx.prepare_fx(model, mapping, inputs)


def timed_with_cpu(fn) -> tuple[float, float, torch.fx.GraphModule]:
    """(wall seconds, process CPU seconds, result) of one call, after a GC (as ``timed``)."""
    gc.collect()
    cpu, start = time.process_time(), time.perf_counter()
    result = fn()
    return time.perf_counter() - start, time.process_time() - cpu, result


def count_nodes(gm: torch.fx.GraphModule) -> int:
    return len(gm.graph.nodes)


def profile_qplug(blocks: int, top: int) -> str:
    model, inputs = make_model(blocks)
    qplug_prepare(model, inputs)  # warm caches (plugin loading, pattern index)
    profiler = cProfile.Profile()
    profiler.enable()
    qplug_prepare(model, inputs)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


class _Phases:
    """Wall-clock time of prepare's steps, by wrapping the functions the flow calls (inclusive,
    so nested entries are part of their parents). No profiler overhead, unlike cProfile."""

    def __init__(self) -> None:
        import copy

        from qplug_core.flows import fuse, pipeline, prepare, regions
        from qplug_core.flows import steps as flows
        from qplug_core.nn import folding
        self.totals: dict[str, float] = {}
        self.patches = [
            (copy, "deepcopy", "copy.deepcopy"),
            (pipeline, "capture_for_quantization", "capture: symbolic trace"),
            (pipeline, "detach_from", "capture: copy what the graph shares with the model"),
            (pipeline, "fuse_graph", "fuse: fuse_graph"),
            (fuse, "find_matches", "fuse: find_matches"),
            (folding, "fold_bn_into_conv", "fuse: fold_bn_into_conv"),
            (flows, "_annotate", "annotate: ValueAnnotator run on example inputs"),
            (regions.RegionPlanner, "plan", "observe: RegionPlanner.plan"),
            (regions, "find_matches", "observe: find_matches"),
            (regions, "dtype_config_problems", "observe: dtype_config_problems"),
            (prepare.ObserverInserter, "insert", "observe: ObserverInserter.insert"),
            (flows, "tag_regions", "observe: tag_regions"),
            (torch.fx.GraphModule, "recompile", "GraphModule.recompile (all passes)"),
        ]
        self.saved = []

    def __enter__(self) -> "_Phases":
        import time
        for owner, attr, label in self.patches:
            original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            self.saved.append((owner, attr, original))
            depth = [0]

            def wrapper(*a, __f=original, __label=label, __depth=depth, **k):
                if __depth[0]:  # recursive calls (deepcopy) count once
                    return __f(*a, **k)
                __depth[0] += 1
                start = time.perf_counter()
                try:
                    return __f(*a, **k)
                finally:
                    __depth[0] -= 1
                    self.totals[__label] = self.totals.get(__label, 0.0) + time.perf_counter() - start
            setattr(owner, attr, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, original in reversed(self.saved):
            setattr(owner, attr, original)


def phases_qplug(blocks: int, reps: int) -> str:
    import gc
    import time
    model, inputs = make_model(blocks)
    qplug_prepare(model, inputs)
    runs = []
    for _ in range(reps):
        with _Phases() as phases:
            gc.collect()
            start = time.perf_counter()
            qplug_prepare(model, inputs)
            total = time.perf_counter() - start
        runs.append((total, phases.totals))
    total, totals = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    rows = [[label, f"{secs:.3f}", f"{secs / total * 100:.0f}%"] for label, secs in totals.items()]
    rows.append(["total prepare_fx", f"{total:.3f}", "100%"])
    gc_off = gc_paused_times(lambda: qplug_prepare(model, inputs), reps)
    rows.append(["total prepare_fx with gc disabled", f"{median(gc_off):.3f}",
                 f"{median(gc_off) / total * 100:.0f}%"])
    return table(["phase (inclusive)", "seconds", "share"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[50, 200, 800])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-ao", action="store_true", help="skip torch.ao (slow at 800 blocks)")
    parser.add_argument("--profile", type=int, default=0, metavar="BLOCKS",
                        help="cProfile qplug's prepare at this many blocks")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--phases", type=int, default=0, metavar="BLOCKS",
                        help="wall-clock breakdown of qplug's prepare steps at this many blocks")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: prepare is single-threaded Python; tiny ops with "
                             "2 OpenMP threads on a loaded box stall for ms each)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tq = None if args.no_ao else torch_ao()
    print(machine_line())
    print(f"prepare_fx on a conv-bn-relu + residual add-relu chain ({CHANNELS} ch, "
          f"{SPATIAL}x{SPATIAL}), median of {args.reps} interleaved reps (seconds)")
    # untimed warm-up: plugin discovery, pattern tables, torch.ao imports
    warm_model, warm_inputs = make_model(2)
    qplug_prepare(warm_model, warm_inputs)
    if tq is not None:
        ao_prepare(tq, warm_model, warm_inputs)

    rows, prev = [], None
    for blocks in args.blocks:
        model, inputs = make_model(blocks)
        ours, ref, ours_cpu = [], [], []
        nodes = observers = ao_observers = 0
        for rep in range(args.reps):
            steps = [("qplug", lambda: qplug_prepare(model, inputs))]
            if tq is not None:
                steps.append(("ao", lambda: ao_prepare(tq, model, inputs)))
            for name, fn in (steps if rep % 2 == 0 else steps[::-1]):
                seconds, cpu, gm = timed_with_cpu(fn)
                if name == "qplug":
                    ours.append(seconds)
                    ours_cpu.append(cpu)
                    observers = sum(1 for n in gm.graph.nodes if n.op == "call_module"
                                    and "activation_post_process" in str(n.target))
                else:
                    ref.append(seconds)
                    ao_observers = sum(1 for n in gm.graph.nodes if n.op == "call_module"
                                       and "activation_post_process" in str(n.target))
                del gm
        nodes = count_nodes(torch.fx.symbolic_trace(model))
        t_ours = median(ours)
        t_ref = median(ref) if ref else float("nan")
        growth = (f"{t_ours / prev[0]:.2f}", f"{t_ref / prev[1]:.2f}" if ref else "-") if prev else ("-", "-")
        rows.append([str(blocks), str(nodes), f"{t_ours:.3f}", f"{median(ours_cpu):.3f}",
                     f"{t_ref:.3f}" if ref else "-",
                     f"{t_ref / t_ours:.1f}x" if ref else "-", growth[0], growth[1],
                     f"{t_ours / nodes * 1e6:.0f}", str(observers), str(ao_observers) if ref else "-"])
        prev = (t_ours, t_ref)
        print(f"  {blocks} blocks done: qplug {t_ours:.3f}s" + (f", torch.ao {t_ref:.3f}s" if ref else ""),
              flush=True)
    print()
    print(table(["blocks", "nodes", "qplug s", "qplug CPU s", "torch.ao s", "speed-up", "qplug growth",
                 "torch.ao growth", "qplug us/node", "qplug obs", "torch.ao obs"], rows))
    if args.phases:
        print(f"\nqplug prepare_fx phases at {args.phases} blocks (median run of {args.reps})")
        print(phases_qplug(args.phases, args.reps))
    if args.profile:
        print(f"\ncProfile of qplug prepare_fx at {args.profile} blocks")
        print(profile_qplug(args.profile, args.top))


if __name__ == "__main__":
    main()
