"""Shared helpers of the end-to-end benches (prepare, quantize, latency).

* :func:`interleaved` times several variants round-robin in a rotating order, so machine noise
  (other engineers' test runs on this shared box) hits every variant alike; report medians/p90.
* :func:`torch_ao` imports ``torch.ao.quantization`` for the comparison only (runtime code never
  does), with its deprecation warnings silenced; ``None`` when torch no longer ships it.
* :func:`machine_line` prints what the figures were measured on, with the load average.
* :func:`json_child` runs a bench's child in a fresh process (another qplug_core tree, say).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def load_average() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:  # pragma: no cover - not on Linux
        return "n/a"
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_line() -> str:
    """The machine, its int8 instruction set (VNNI or not decides what the figures mean) and the
    qplug tree measured: this file puts its own checkout first on ``sys.path``."""
    import qplug_core
    from qplug_core.plugin_api import cpu_int8

    return (f"{time.strftime('%Y-%m-%d %H:%M')}  {cpu_model()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"load avg {load_average()}\n"
            f"int8: {cpu_int8().summary()}; qplug_core from {Path(qplug_core.__file__).parent}")


def torch_ao():
    """``torch.ao.quantization`` (comparison only), or None when absent."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch.ao.quantization as tq
            import torch.ao.quantization.quantize_fx as tq_fx
    except ImportError:
        return None
    tq.quantize_fx = tq_fx
    return tq


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence warnings and stderr chatter (backend announcements, progress bars) of a step."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def rss_bytes() -> int:
    """Resident bytes after a GC and ``malloc_trim`` (freed float copies go back to the OS)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def json_child(script: str, pythonpath: list[Path], *args: str) -> dict:
    """The last line ``python script *args`` prints, read as JSON, from a fresh process importing
    from ``pythonpath`` (two versions of qplug_core cannot share a process); exits with the tail
    of its stderr if it failed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in pythonpath))
    done = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True,
                          cwd=tempfile.gettempdir())
    if done.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call, after a GC so collection debt is not billed to ``fn``."""
    gc.collect()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def gc_paused_times(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of ``repeats`` calls with the garbage collector paused, as ``timeit`` does."""
    times = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return times


def interleaved(variants: dict[str, Callable[[], Any]], rounds: int, *, warmup: int = 1,
                inner: int = 1, clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of every variant over ``rounds`` rotating rounds (after ``warmup`` ones).

    Each round runs each variant ``inner`` times back to back and records the mean per call.
    ``clock=time.process_time`` counts this process's CPU seconds instead of wall seconds: on the
    loaded shared box a call's wall time also holds the slices other processes ran meanwhile.
    """
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn = variants[name]
            start = clock()
            for _ in range(inner):
                fn()
            elapsed = (clock() - start) / inner
            if r >= warmup:
                samples[name].append(elapsed)
    return samples


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def p90(xs: list[float]) -> float:
    ordered = sorted(xs)
    if len(ordered) == 1:
        return ordered[0]
    k = 0.9 * (len(ordered) - 1)
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A plain right-aligned text table (first column left-aligned)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(header), "-" * len(line(header))]
    out += [line(r) for r in rows]
    return "\n".join(out)


def run_models(doc: str, models: list[str], run: Callable[[str, list[int], int], list[list[str]]],
               header: list[str]) -> None:
    """The ``main()`` of a bench over named models and batch sizes (``--models``, ``--batches``,
    ``--rounds``): one thread, the machine line, then one table of every model's rows."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=models, choices=models)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    print(table(header, [row for name in args.models for row in run(name, args.batches, args.rounds)]))
